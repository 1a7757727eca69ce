"""Old import paths of renamed modules: importing one gives the new module and warns once,
naming the new path (``tests/test_architecture.py`` checks every entry of ``MOVED``)."""

from __future__ import annotations

import importlib
import sys
import warnings

#: old module -> (new module, why the name changed)
MOVED: dict[str, tuple[str, str]] = {
    "sac_compile.hf_plan": (
        "sac_compile.hf.plan",
        "the transformers integration is one package, sac_compile.hf",
    ),
    "sac_compile.hf_layers": (
        "sac_compile.hf.layers",
        "the transformers integration is one package, sac_compile.hf",
    ),
    "sac_compile.scope_text": ("sac_compile.actions", "it holds a scope's Actions"),
    "sac_compile.contexts": ("sac_compile.context_fn", "it holds region_context_fn"),
    "sac_compile.eager.bodies": ("sac_compile.eager.kept_bodies", "it holds the kept module bodies"),
    "sac_compile.diagnostics.judge": (
        "sac_compile.diagnostics.unused_keep",
        "it judges which keep names no region recorded",
    ),
}


def alias(old: str) -> None:
    """Make the module ``old`` (being imported) the new one, with a ``FutureWarning``."""
    new, why = MOVED[old]
    module = importlib.import_module(new)
    warnings.warn(f"{old} is {new} ({why}): import {new}", FutureWarning, stacklevel=3)
    sys.modules[old] = module
