"""benchmarks/eager_layer.py measures what it says: its bare-modes configuration is full
recompute plus the engine's spans (nothing cached, gradients exact), and it prints the
bounds issue #17's verdict rests on."""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from sac_compile.eager import checkpoint_with_regions
from sac_compile.eager.modes import CachedMode, CachingMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import _eager_models  # noqa: E402
import eager_layer  # noqa: E402

TINY = ["--demo-d", "32", "--demo-seq", "16", "--demo-batch", "2", "--demo-layers", "1"]


def _demo_layer():
    sizes = argparse.Namespace(demo_d=32, demo_seq=16, demo_batch=2, demo_layers=1)
    subject = _eager_models.demo(sizes)
    layer, h = subject.layer_call(copy.deepcopy(subject.model))
    return layer, h, frozenset(subject.keep)


def _grads(layer, h, step):
    step().sum().backward()
    grads = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad(set_to_none=True)
    return grads


def test_bare_modes_cache_nothing_and_give_full_recomputes_gradients():
    layer, h, keep = _demo_layer()
    full = _grads(layer, h, lambda: checkpoint(layer, h, use_reentrant=False))
    stats: list = []
    with eager_layer._bare_modes():
        bare = _grads(layer, h, lambda: checkpoint_with_regions(layer, h, keep=keep, stats_out=stats))
    assert all(torch.equal(a, b) for a, b in zip(full, bare, strict=True))
    # the kept regions were entered, yet nothing was cached or counted: every op passed through
    assert stats[0].regions_entered and stats[0].spans > 0
    assert stats[0].cached_ops == 0 and sum(stats[0].intercepted.values()) == 0


def test_bare_modes_put_the_engines_modes_back():
    layer, h, keep = _demo_layer()
    before = CachingMode.__torch_dispatch__, CachedMode.__torch_dispatch__
    with eager_layer._bare_modes():
        pass
    assert (CachingMode.__torch_dispatch__, CachedMode.__torch_dispatch__) == before
    stats: list = []
    checkpoint_with_regions(layer, h, keep=keep, stats_out=stats).sum().backward()
    assert stats[0].cached_ops > 0  # the engine caches again


@pytest.mark.slow
def test_the_benchmark_prints_the_bounds(capsys):
    found = eager_layer.main(["--models", "demo", "--iters", "2", *TINY])
    out = capsys.readouterr().out
    r = found["demo"]
    assert set(r["rows"]) == {
        "no checkpoint",
        "full recompute",
        "engine",
        "torch SAC",
        "torch SAC, none",
        "bare modes",
    }
    rows = {k: v["step_ms"] for k, v in r["rows"].items()}
    # the budgets are the stated differences of the medians
    assert abs(r["decisions_gain_ms"] - (rows["torch SAC, none"] - rows["torch SAC"])) < 1e-9
    assert abs(r["bare_modes_ms"] - (rows["bare modes"] - rows["full recompute"])) < 1e-9
    lo, hi = r["engine_vs_full_95"]
    assert lo <= hi
    assert "bare modes cost" in out and "reaches 0.85x only under" in out
