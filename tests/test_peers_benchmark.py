"""benchmarks/peers.py, at tiny sizes: each peer runs through its documented API with the
gradients of no checkpoint, and the byte verdicts hold (bytes do not depend on the machine;
step times do, and are the benchmark's to print, not a test's)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import peers  # noqa: E402

from .releases import beyond, default_torch_only  # noqa: E402

TINY = ["--iters", "1", "--layers", "1", "--batch", "2", "--seq", "16", "--d", "32", "--demo-d", "32"]
TINY += ["--hf-hidden", "32", "--hf-batch", "2", "--hf-seq", "16", "--inner", "aot_eager"]

needs_remat = pytest.mark.skipif(peers.remat is None, reason="torch_remat is not installed (the bench extra)")


def _rows(key: str, *flags: str) -> tuple[peers.Model, dict]:
    args = peers.parse_args([*TINY, *flags])
    model = peers.MODELS[key](args)
    return model, peers.run_model(model, args)[1]


@pytest.mark.slow
@needs_remat
@default_torch_only  # a benchmark script end to end (tests/releases.py)
@pytest.mark.parametrize("key", beyond(["blocks", "demo", "llama"], "llama"))
def test_save_all_holds_no_more_than_torch_remat_eagerly(key):
    """For every keep set, the kept modules' bodies skipped under SAVE_ALL hold no more than
    torch_remat's save regions, but for the CPU generator's state per layer (replayed by
    default; torch_remat does not). Red before the skipped bodies gave the arguments they
    save to the checkpoint: they held one activation per kept module more (the norm's output
    its projection saves)."""
    model, found = _rows(key, "--no-compiled")
    rng_states = torch.get_rng_state().nbytes  # (one layer)
    rows = found["eager"]
    for name, r in rows.items():
        assert "failed" not in r, (name, r)
        assert r["dgrad"] < 1e-5, (name, r["dgrad"])  # every configuration trains alike
    for keep in model.keep_sets:
        k = peers.keep_text(keep)
        ours, theirs = rows[f"ours SAVE_ALL keep={k}"], rows[f"torch_remat keep={k}"]
        assert ours["bytes"] <= theirs["bytes"] + rng_states, (k, ours["bytes"], theirs["bytes"])
        assert ours["flops"] <= theirs["flops"], k  # (early stop: never more recompute)
    assert rows["full recompute"]["flops"] > 0 == rows["no checkpoint"]["flops"]


@needs_remat
@default_torch_only
@pytest.mark.slow
def test_compiled_we_hold_less_than_torch_remat():
    """Compiled (aot_eager here), ours holds no more than torch_remat for every keep set, with
    the same gradients."""
    model = peers.MODELS["blocks"](peers.parse_args(TINY))
    rows = peers.measure(model, peers.compiled_configs(model, "aot_eager"), 1)
    for name, r in rows.items():
        assert r["dgrad"] < 1e-5, (name, r["dgrad"])
    for keep in model.keep_sets:
        k = peers.keep_text(keep)
        assert rows[f"ours keep={k}"]["bytes"] <= rows[f"torch_remat keep={k}"]["bytes"], k


def test_without_torch_remat_the_benchmark_says_so(monkeypatch, capsys):
    monkeypatch.setattr(peers, "remat", None)
    assert peers.main(TINY) == 0
    assert "torch_remat is not installed" in capsys.readouterr().out
