"""The post pass: Inductor's seed-drawing nodes stay untagged.

Inductor's ``replace_random_passes`` runs after the tagging pass: it rewrites each random
op into ``inductor_random(..., inductor_seed(device))``, the new nodes copying the random
op's ``meta`` (our ``recompute`` / ``ac_graph_id`` included), and
``fuse_seed_creation_pass`` replaces a device's seeds with one ``inductor_seeds`` node.
Since torch 2.14 that fused node copies the first seed's ``meta`` as well
(``torch/_inductor/fx_passes/replace_random.py``), so it inherits ``MUST_RECOMPUTE`` when
the first random op sits in a recomputed region. The partitioner then wraps it in
``run_and_save_rng_state``, whose eager ``randint`` draws other seeds than Inductor's
lowering: gradients stay consistent with the forward's masks, but the step no longer
reproduces the no-checkpoint run under the same seed. Seeds are drawn once, in the
forward, by the partitioner's own rules: this ``joint_custom_post_pass`` clears our tags
on the seed-drawing nodes (on 2.13, where the fused node is made without ``meta``, it
finds nothing to clear). ``lookup_seed`` (a pure index into the drawn seeds) keeps its
tag, as on every release.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from .._compat.inductor import custom_graph_pass_base, get_hash_for_files, seed_creation_ops

__all__ = ["UNTAG_SEEDS", "UntagSeedsPass"]

# Inductor's CustomGraphPass: a class that only exists at run time (importing it loads Inductor)
_PASS_BASE: Any = custom_graph_pass_base()


class UntagSeedsPass(_PASS_BASE):
    """Inductor ``joint_custom_post_pass``: no ``recompute`` / ``ac_graph_id`` on seed nodes."""

    def __call__(self, graph: fx.Graph) -> None:
        seeds = seed_creation_ops()
        for node in graph.nodes:
            if node.op == "call_function" and node.target in seeds:
                node.meta.pop("recompute", None)
                node.meta.pop("ac_graph_id", None)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))

    def __repr__(self) -> str:
        return "UntagSeedsPass()"


UNTAG_SEEDS = UntagSeedsPass()
