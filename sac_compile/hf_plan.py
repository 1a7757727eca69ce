"""Moved: ``sac_compile.hf_plan`` is :mod:`sac_compile.hf.plan`. Importing the old path still
works (the module is the new one) and warns once, naming the new path."""

import sys
import warnings

from .hf import plan as _moved

warnings.warn(
    "sac_compile.hf_plan is sac_compile.hf.plan (the transformers integration is one package, "
    "sac_compile.hf): import sac_compile.hf.plan",
    FutureWarning,
    stacklevel=2,
)
sys.modules[__name__] = _moved
