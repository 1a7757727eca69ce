"""benchmarks/trainer_layouts.py runs end to end at a tiny size and flags nothing: every layout
keeping ``attn`` holds less than no checkpoint and reruns no attention (its exit code)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import trainer_layouts  # noqa: E402

from .releases import extended  # noqa: E402


# about 25 layouts compiled with aot_eager (123 s in a CI run): the breadth tier, as what it
# measures is held in CI by tests/test_compiled_forward.py, layout by layout at 32 layers
@extended
@pytest.mark.slow
def test_the_trainer_layouts_benchmark_flags_no_layout(capsys):
    got = trainer_layouts.main(["--layers", "2", "--d", "32", "--tokens", "128"])
    assert not got["flagged"], got["flagged"]
    rows = got["results"]["DenseLayer"]
    none = rows["no checkpoint"]["held"]
    # the compiled layouts hold what the seam's own compile= holds, and less than no checkpoint
    for name in ("class forward compiled", "seam inside compiled checkpoint_wrapper"):
        assert rows[name]["held"] == rows["seam compile="]["held"] < none, (name, rows)
    assert "xtuner dense" in capsys.readouterr().out
