"""Selective checkpointing of a Hugging Face Llama with regions declared by module path.

A tiny random-weight ``LlamaForCausalLM`` (no download). No line of the model is
edited: ``sac_compile.hf.config_for`` declares ``attn`` (``model.layers.*.self_attn``)
and ``mlp`` (``model.layers.*.mlp``) and wraps every decoder layer. Trains a few
steps eagerly and compiled, compares with the un-checkpointed model, and prints
the partition report of one layer per region.

    python examples/hf_llama.py [--steps 3] [--inner inductor|aot_eager]
"""

from __future__ import annotations

from _hf_walkthrough import options, walkthrough

from sac_compile.testing import hf_families

if __name__ == "__main__":
    args = options(__doc__)
    walkthrough(lambda: hf_families.tiny_llama().train(), {"attn"}, steps=args.steps, inner=args.inner)
