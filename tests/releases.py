"""Which PyTorch release the suite runs on, and the checks that run on the default one only.

CI runs the whole suite twice (torch 2.13.0, then 2.15.0). To keep CI within its time (docs/testing.md),
checks whose PyTorch-facing code the rest of the suite already covers on every release (a
benchmark script end to end, a trainer, planning whole transformers models) run on the default
2.13.0 only (docs/testing.md).
"""

from __future__ import annotations

import pytest
import torch

TORCH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])

default_torch_only = pytest.mark.skipif(
    TORCH > (2, 13), reason="runs on the default torch 2.13.0 (CI time: docs/testing.md)"
)
