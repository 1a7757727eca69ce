"""transformers families out of the box: what each keep set holds, eager and compiled.

One run, side by side, on every family of ``sac_compile.testing.hf_families`` (tiny
random ``*ForCausalLM`` models, CPU, float32, the family's own dropout). Regions are read
by ``sac_compile.hf.regions_for``; every decoder layer is wrapped by
``hf.config_for(model, keep=...)``:

* no checkpoint (eager; compiled per layer with the same backend minus the tagging pass);
* keep=() -- full recompute;
* each region the model has, kept alone;
* every region kept (``ALL_REGIONS``).

Bytes = ``sac_compile.inspection.autograd_saved_bytes`` of the forward (logits), parameters
excluded: what is held for the backward whatever the mode (autograd's saves, the
checkpoints' inputs and RNG state, the eager engine's cache, compiled saves). Ratios are
to the same mode's no-checkpoint bytes. The ordering every family should show is
full recompute < each region < every region <= no checkpoint; a row that breaks it is
flagged ``!`` and the script exits 1.

    python benchmarks/hf_families.py [--families llama,jamba] [--compiled] [--seq 64 --batch 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings

import torch

import sac_compile as sc
from sac_compile import hf
from sac_compile.testing.hf_families import FAMILIES, build, held_bytes


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated (default: all)")
    parser.add_argument("--compiled", action="store_true", help="also compiled per layer (aot_eager): slower")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="also print the figures as JSON")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    modes = ["eager", "compiled"] if args.compiled else ["eager"]
    ids = torch.randint(1, 128, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    print(
        f"transformers families (tiny random configs, hidden 32, float32, CPU), batch {args.batch}, "
        f"seq {args.seq}; bytes held for the backward per forward (parameters excluded), "
        "ratio to the same mode's no checkpoint"
    )
    print(f"{'family':<19} {'mode':<8} {'no ckpt B':>10} {'full':>6} {'all':>6}   each region kept alone")
    rows, broken = [], []
    for family in args.families.split(","):
        regions = sorted(set(hf.regions_for(build(family)).values()))
        for mode in modes:
            compiled = mode == "compiled"
            try:
                none = held_bytes(family, None, ids, compiled=compiled)
            except Exception as e:  # noqa: BLE001 (a family PyTorch cannot compile: say so, go on)
                print(f"{family:<19} {mode:<8} failed without checkpointing: {str(e).splitlines()[0][:90]}")
                continue
            full = held_bytes(family, (), ids, compiled=compiled)
            every = held_bytes(family, sc.ALL_REGIONS, ids, compiled=compiled)
            each = {r: held_bytes(family, {r}, ids, compiled=compiled) for r in regions}
            ok = full < min(each.values()) and max(each.values()) <= every <= none
            flag = "" if ok else " !"
            if not ok:
                broken.append(f"{family} ({mode})")
            alone = ", ".join(f"{r} {b / none:.2f}" for r, b in each.items())
            print(
                f"{family:<19} {mode:<8} {none:>10,} {full / none:>6.2f} {every / none:>6.2f}   {alone}{flag}"
            )
            rows.append(
                {"family": family, "mode": mode, "regions": regions, "none": none, "full": full, "all": every}
                | {f"keep {r}": b for r, b in each.items()}
            )
    print(
        "ordering full < each region < all <= no checkpoint: "
        + ("holds on every row" if not broken else "broken on " + ", ".join(broken))
    )
    if args.json:
        print(json.dumps(rows))
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
