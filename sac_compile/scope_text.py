"""Moved: see ``sac_compile._moved.MOVED``."""

from ._moved import alias

alias(__name__)
