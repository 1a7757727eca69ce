"""The compile-native engine: the Dynamo backends (:mod:`.backend`) and the compile
session they run in (:mod:`.session`). The tagging pass lives in :mod:`sac_compile.passes`."""

from __future__ import annotations

from .backend import SacBackend, baseline_backend, make_sac_backend, sac_backend
from .session import CompileUnit, capture_units

__all__ = [
    "CompileUnit",
    "SacBackend",
    "baseline_backend",
    "capture_units",
    "make_sac_backend",
    "sac_backend",
]
