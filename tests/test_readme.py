"""The README's 20-line example runs as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from .releases import default_torch_only

README = Path(__file__).resolve().parents[1] / "README.md"

pytestmark = [pytest.mark.slow, pytest.mark.subprocess, default_torch_only]


def _example() -> str:
    text = README.read_text()
    section = text[text.index("## A 20-line example") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_example_runs_and_keeps_attention(tmp_path):
    code = _example()
    assert 20 <= len(code.strip().splitlines()) <= 32
    script = tmp_path / "readme_example.py"
    script.write_text(code)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    # the partition report of layer 0: attention kept, the MLP recomputed
    assert "attn(kept)" in done.stdout and "mlp(recomputed)" in done.stdout, done.stdout
