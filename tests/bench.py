"""A script of ``benchmarks/`` run as ``make bench`` runs it: its own interpreter, from that folder."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_benchmark(script: str, argv: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    """``python benchmarks/<script> *argv``, its output captured."""
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT / "benchmarks",
    )
