"""Which PyTorch release the suite runs on, and what runs on every release.

CI runs the suite on the default torch 2.13.0, then on the newest supported release (2.15.0).
To keep CI within its time (docs/testing.md), on a newer release `make test` runs the release
tier: the unit tier (every test not marked ``slow``, ``distributed`` or ``subprocess``) and
the tests marked :data:`every_release` -- one end-to-end check of each PyTorch-facing path
whose behaviour a release can change and the unit tier does not reach: Inductor's compile and
its caches, the named backend found by entry point, DTensor tensor parallel (eager and
compiled: 2.13 cannot compile every keep set), FSDP2, transformers' Trainer compiled,
torchtitan's trainer under TP + compile (2.14 and later only). ``default_torch_only`` marks
the unit-tier tests that run on 2.13.0 only (a script run end to end).
"""

from __future__ import annotations

import pytest
import torch

TORCH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])

default_torch_only = pytest.mark.skipif(
    TORCH > (2, 13), reason="runs on the default torch 2.13.0 (CI time: docs/testing.md)"
)

every_release = pytest.mark.every_release
