"""Selective checkpointing of a Hugging Face mixture-of-experts model (Qwen3-MoE).

A tiny random-weight ``Qwen3MoeForCausalLM`` (no download), regions declared by
module path: ``attn`` (``model.layers.*.self_attn``), ``router``
(``model.layers.*.mlp.gate``) and ``experts`` (``model.layers.*.mlp.experts``).
Both expert implementations of transformers 5.x are covered:

* ``grouped_mm`` (the default): eager and compiled, compared with no checkpoint;
* ``eager`` (a per-expert loop accumulating with ``index_add_``): the eager
  engine recomputes the written buffer and its producer, bit-identical to no
  checkpoint. Under torch.compile that loop graph-breaks at ``nonzero`` and runs
  uncompiled, which the diagnostics report.

    python examples/hf_moe.py [--steps 3] [--inner inductor|aot_eager]
"""

from __future__ import annotations

import logging

from _hf_walkthrough import options, walkthrough

from sac_compile.testing import hf_families

if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    args = options(__doc__)
    keep = {"attn", "experts"}
    print("######## experts_implementation='grouped_mm' ########")
    walkthrough(lambda: hf_families.tiny_qwen3_moe().train(), keep, steps=args.steps, inner=args.inner)
    print("\n######## experts_implementation='eager' (index_add_ accumulation) ########")
    walkthrough(
        lambda: hf_families.tiny_qwen3_moe(experts_implementation="eager").train(),
        keep,
        steps=args.steps,
        inner=args.inner,
    )
    print(
        "note: with the 'eager' experts the loop between the graph breaks runs uncompiled; autograd saves "
        "its activations outside the compiled graphs, so they are not in the bytes above (use the eager "
        "engine, compile=False, to checkpoint that loop selectively)."
    )
