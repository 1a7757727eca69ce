"""Which transformers families ``sac_compile.hf`` reads: every stack, on the meta device.

For each family of a transformers auto-mapping, the model is built on the meta device (nothing
allocated) from the family's default config shrunk to a generic tiny size (hidden 32, two layers,
four heads, vocabulary 256, in the config and every sub-config), then read: ``hf.stacks`` (every
list of layers transformers checkpoints) and ``hf.regions_for`` (the regions of each stack's
layers) and ``hf.unchecked`` (lists of layers transformers does not checkpoint, which
``config_for`` reports and checkpoints with ``include=``). A family is ``read`` (its stacks,
their regions and its unchecked lists printed), ``refused`` (the
``ValueError`` naming what ``hf`` does not recognise) or ``not built`` (the generic tiny config
does not build that family: not measured).

    python benchmarks/hf_scan.py [--task image-text-to-text|causal-lm|seq2seq|speech-seq2seq] [--families a,b]
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from collections import Counter

import torch

from sac_compile import hf

TASKS = {
    "causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "image-text-to-text": "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
    "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "speech-seq2seq": "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
}
_TINY = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    depth=2,
    embed_dim=32,
    num_heads=4,
    vocab_size=256,
    out_hidden_size=32,
    head_dim=8,
    projection_dim=32,
)


def _shrink(config) -> None:
    for key, value in _TINY.items():
        if hasattr(config, key):
            try:
                setattr(config, key, value)
            except (AttributeError, ValueError, TypeError):
                pass  # a derived or per-layer attribute: left as the family sets it
    for name in getattr(config, "sub_configs", None) or {}:
        sub = getattr(config, name, None)
        if sub is not None and hasattr(sub, "to_dict"):
            _shrink(sub)


def scan(task: str, families: list[str] | None = None) -> dict[str, tuple[str, str]]:
    """``{family: (outcome, detail)}``; outcome one of ``read``, ``refused``, ``not built``."""
    import transformers
    from transformers.models.auto import configuration_auto, modeling_auto

    mapping = getattr(modeling_auto, TASKS[task])
    out = {}
    for family in families or list(mapping):
        model_cls = mapping[family]
        model_cls = model_cls[0] if isinstance(model_cls, (tuple, list)) else model_cls
        try:
            config = configuration_auto.CONFIG_MAPPING[family]()
            _shrink(config)
            with torch.device("meta"):
                model = getattr(transformers, model_cls)._from_config(config)
        except Exception as e:  # the generic tiny config does not fit this family
            out[family] = ("not built", f"{type(e).__name__}: {str(e).splitlines()[0][:100]}")
            continue
        try:
            stacks, regions = hf.stacks(model), hf.regions_for(model)
        except ValueError as e:
            out[family] = ("refused", str(e).split(". Write")[0])
            continue
        per_stack = [
            f"{s} [{', '.join(sorted({r for p, r in regions.items() if p.startswith(f'{s}.')}))}]"
            for s in stacks
        ]
        left = hf.unchecked(model)
        out[family] = ("read", "; ".join(per_stack) + (f" | unchecked: {', '.join(left)}" if left else ""))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--task", default="image-text-to-text", choices=list(TASKS))
    parser.add_argument(
        "--families", default=None, help="comma-separated (default: every family of the task)"
    )
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    import transformers

    found = scan(args.task, args.families.split(",") if args.families else None)
    counts = Counter(outcome for outcome, _ in found.values())
    read = [detail for outcome, detail in found.values() if outcome == "read"]
    stacks = Counter(detail.split(" | ")[0].count("; ") + 1 for detail in read)
    unchecked = sum(" | unchecked: " in detail for detail in read)
    print(f"transformers {transformers.__version__}, {args.task}: {len(found)} families")
    for family, (outcome, detail) in found.items():
        print(f"  {family:<28} {outcome:<9} {detail}")
    print(
        f"read {counts['read']}, refused {counts['refused']}, not built {counts['not built']}; "
        f"stacks per read family: {dict(sorted(stacks.items()))}; with lists of layers transformers does not "
        f"checkpoint (hf.unchecked: reported, include= checkpoints them): {unchecked}"
    )
    return 1 if counts["refused"] else 0


if __name__ == "__main__":
    sys.exit(main())
