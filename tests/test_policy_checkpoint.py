"""The marker-reading policy a wrapped layer uses inside a foreign checkpoint compiled without the
pass (Note [a seam inside a checkpoint compiled without the pass] in sac_compile/policy_checkpoint.py)."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import CheckpointPolicy

import sac_compile as sc
from sac_compile.actions import Actions
from sac_compile.markers.ops import REGION_ENTER, REGION_EXIT, SCOPE_ENTER
from sac_compile.policy_checkpoint import _MarkerPolicy, marker_policy_context_fn

aten = torch.ops.aten
MM, ADD = aten.mm.default, aten.add.Tensor


def _decisions(actions: Actions, ops: list) -> list:
    policy = _MarkerPolicy(actions)
    return [policy(None, op, *args) for op, *args in ops]


def test_a_kept_regions_costly_ops_are_saved_the_rest_recomputed():
    ops = [
        (MM,),  # outside every region
        (SCOPE_ENTER, 0, "keep=attn"),  # (scope markers decide nothing here)
        (REGION_ENTER, "attn"),
        (MM,),  # costly, in a kept region: saved
        (ADD,),  # cheap: recomputed
        (REGION_ENTER, "mlp"),
        (MM,),  # in attn and mlp: attn is kept (union)
        (REGION_EXIT, "mlp"),
        (REGION_EXIT, "attn"),
        (REGION_ENTER, "mlp"),
        (MM,),  # in mlp only: not kept
        (REGION_EXIT, "mlp"),
        (MM,),
    ]
    got = _decisions(Actions.of({"attn"}), ops)
    saved = [i for i, d in enumerate(got) if d is CheckpointPolicy.MUST_SAVE]
    assert saved == [3, 6], got
    assert all(
        d in (CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.MUST_RECOMPUTE)
        for i, d in enumerate(got)
        if i not in saved
    )


def test_the_region_policy_of_the_layer_decides():
    """SAVE_ALL saves a kept region's cheap ops too; entries are counted (a name open twice stays
    open until closed twice)."""
    ops = [(REGION_ENTER, "a"), (REGION_ENTER, "a"), (REGION_EXIT, "a"), (ADD,), (REGION_EXIT, "a"), (ADD,)]
    got = _decisions(Actions.of({"a"}, sc.SAVE_ALL), ops)
    assert got[3] is CheckpointPolicy.MUST_SAVE and got[5] is not CheckpointPolicy.MUST_SAVE, got


def test_each_checkpoint_call_gets_a_fresh_policy():
    """The context_fn is a partial of a module function over a string (what Dynamo accepts), and
    each call makes new contexts, so a trace never starts inside the last one's regions."""
    fn = marker_policy_context_fn(Actions.of({"attn"}).text)
    assert fn.func.__module__ == "sac_compile.policy_checkpoint" and fn.args == (Actions.of({"attn"}).text,)
    first, second = fn(), fn()
    assert first[0] is not second[0]
