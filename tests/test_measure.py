"""sac_compile.inspection.measure: counting held bytes is silent."""

from __future__ import annotations

import warnings

import torch
import torch.distributed  # holds the deprecated ``reduce_op`` object the garbage-collector walk meets

import sac_compile as sc


def test_autograd_saved_bytes_warns_nothing():
    """Red while the walk over every live object asked ``isinstance(obj, torch.Tensor)``:
    reading ``__class__`` of ``torch.distributed.reduce_op`` raises a FutureWarning."""
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        held = sc.inspection.autograd_saved_bytes(lambda: torch.relu(lin(x)).sum(), exclude=lin.parameters())
    assert held > 0
    assert not [str(w.message) for w in caught], [str(w.message) for w in caught]
