"""Moved: ``sac_compile.hf_layers`` is :mod:`sac_compile.hf.layers`. Importing the old path still
works (the module is the new one) and warns once, naming the new path."""

import sys
import warnings

from .hf import layers as _moved

warnings.warn(
    "sac_compile.hf_layers is sac_compile.hf.layers (the transformers integration is one package, "
    "sac_compile.hf): import sac_compile.hf.layers",
    FutureWarning,
    stacklevel=2,
)
sys.modules[__name__] = _moved
