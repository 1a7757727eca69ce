"""Eager and compiled SAC keep the same regions and, under the same region policy, hold the
same bytes per region on a transformer block (exactly: both save a kept region's costly values
that the backward reads, and recompute the rest)."""

import pytest
import torch

import sac_compile as sc
from sac_compile.testing.models import Block

from .parity import parity_report

# aot_eager: what is saved is decided before codegen; Inductor's partitions are compared
# with aot_eager's in tests/test_partition_reports.py
CASES = [(keep, "aot_eager") for keep in ((), {"attn"}, {"mlp"}, sc.ALL_REGIONS)]


@pytest.mark.parametrize("keep, inner", CASES, ids=["none", "attn", "mlp", "all"])
def test_same_regions_saved_and_compiled_holds_no_more(keep, inner):
    torch.manual_seed(0)
    block = Block(32, heads=4)
    x = torch.randn(2, 16, 32, requires_grad=True)
    report = parity_report(block, x, keep=keep, inner=inner)
    print(report.format())
    expected = set() if keep == () else ({"attn", "mlp"} if keep is sc.ALL_REGIONS else set(keep))
    assert report.saved_regions("eager") == report.saved_regions("compiled") == expected
    # the same bytes per region; the RNG state is not a region: before torch 2.15 the
    # partitioner stashes it for a recomputed SDPA kernel even without dropout (it carries
    # the nondeterministic_seeded tag), which the eager engine and 2.15 do not
    regions = {k: v for k, v in report.compiled.items() if k != "rng"}
    assert {k: v for k, v in report.eager.items() if k != "rng"} == regions
    assert report.eager.get("rng", 0) == 0
    assert report.eager["input"] == report.compiled["input"] == x.numel() * 4
