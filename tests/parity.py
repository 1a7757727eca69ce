"""Eager/compiled parity: what each mode holds for backward, per region.

Eager: the engine's own cache after the forward (what it keeps of the kept
regions, per region) plus what the checkpoint itself keeps (the inputs of the
checkpointed call). ``saved_tensors_hooks`` cannot see inside a checkpoint, so
this is read from the engine. Compiled: the partition report of the same module
and keep set. Parameters are left out on both sides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn as nn

from sac_compile.compiler.backend import make_sac_backend
from sac_compile.eager import checkpoint_with_regions
from sac_compile.inspection import capture_partition
from sac_compile.keep import INPUT, NO_REGION, PARAM, RNG, Keep, KeepSet, format_keep, normalize_keep

__all__ = ["ParityReport", "parity_report"]


@dataclass
class ParityReport:
    keep: KeepSet
    eager: dict[str, int]  # region ("a+b", "-", "input") -> bytes held for backward
    compiled: dict[str, int]

    @property
    def eager_bytes(self) -> int:
        return sum(self.eager.values())

    @property
    def compiled_bytes(self) -> int:
        return sum(self.compiled.values())

    def saved_regions(self, side: str) -> set[str]:
        """Region names owning saved activations (inputs and "-" left out)."""
        held = self.eager if side == "eager" else self.compiled
        return {
            n for key, b in held.items() if b and key not in (INPUT, NO_REGION, RNG) for n in key.split("+")
        }

    def format(self) -> str:
        keys = sorted(set(self.eager) | set(self.compiled))
        width = max([len(k) for k in keys] + [6])
        lines = [
            f"keep={format_keep(self.keep) or '()'}",
            f"{'region':<{width}}  {'eager B':>10}  {'compiled B':>10}",
        ]
        for k in keys:
            lines.append(f"{k:<{width}}  {self.eager.get(k, 0):>10}  {self.compiled.get(k, 0):>10}")
        lines.append(f"{'total':<{width}}  {self.eager_bytes:>10}  {self.compiled_bytes:>10}")
        return "\n".join(lines)


def parity_report(
    module: nn.Module, *args: Any, keep: Keep, inner: Literal["inductor", "aot_eager"] = "inductor"
) -> ParityReport:
    """Run ``module(*args)`` once eagerly under the engine and once compiled; compare."""
    keep_set = normalize_keep(keep)
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    stats: list = []
    out = checkpoint_with_regions(module, *args, keep=keep_set, stats_out=stats)
    eager = dict(stats[0].held_by_region)
    inputs = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in args
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in params
    }
    if inputs:
        eager[INPUT] = sum(inputs.values())
    out.sum().backward()
    report = capture_partition(module, *args, backend=make_sac_backend(keep_set, inner=inner))
    compiled = {k: v for k, v in report.bytes_by_region().items() if k != PARAM and v}
    return ParityReport(keep_set, {k: v for k, v in eager.items() if v}, compiled)
