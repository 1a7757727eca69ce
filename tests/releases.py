"""Which PyTorch release the suite runs on, what runs on every release, and what CI leaves out.

CI (``.ci/run``) runs ``make test`` on the default torch 2.13.0: every test but those marked
:data:`extended` -- a capability that a cheaper test of the CI tier proves already, checked
again on more models, sizes or configurations (the breadth: every family, every stack, a
second model of the same kind). ``make test TIER=`` runs them all (docs/testing.md: before a
release, and at the end of a session that touched what they cover).

A newer release runs in its own venv (``make test TORCH=2.15.0``: installing its ~3 GB CUDA
build alone takes minutes, past CI's time), before a release. There ``make test`` runs the release
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

extended = pytest.mark.extended


def beyond(values: list, *in_ci: object) -> list:
    """``values`` for ``pytest.mark.parametrize``, those not in ``in_ci`` marked :data:`extended`
    (the breadth of a parametrized test: ``in_ci`` names what CI runs)."""
    missing = [v for v in in_ci if v not in values]
    assert not missing, f"{missing} not among {values}"
    return [v if v in in_ci else pytest.param(v, marks=extended) for v in values]
