"""Where offloaded values land: bytes held on the device and moved to the host, per region.

One decoder layer of a tiny transformers Llama and Qwen3-MoE (hidden 256, batch 2 x seq 512,
float32, CPU, compiled with ``aot_eager``), side by side: no checkpoint, every region kept,
every region offloaded (``offload=`` through PyTorch's partitioner offload pass). Offloading
moves what keeping saves, except what PyTorch's pass leaves on the device: views, ``getitem``s
(the attention kernel's outputs) and non-contiguous values. On a CPU the "host" is the same
memory: the figures are the partition's bookkeeping, not a transfer.

    python benchmarks/offload_bytes.py [--hidden 256 --seq 512 --batch 2]
"""

from __future__ import annotations

import argparse

import torch

import sac_compile as sc
from sac_compile import hf
from sac_compile.testing.hf_families import tiny_llama, tiny_qwen3_moe


def rows(build, hidden: int, batch: int, seq: int) -> list[tuple[str, dict, dict]]:
    model = build(layers=1, hidden=hidden).train()
    regions = hf.regions_for(model)
    sc.declare_regions(model, regions)
    names = set(regions.values())
    layer = model.model.layers[0]
    x = torch.randn(batch, seq, hidden, requires_grad=True)
    positions = torch.arange(seq).unsqueeze(0)
    rope = model.model.rotary_emb(x, positions)

    def run(x):
        return layer(x, attention_mask=None, position_ids=positions, position_embeddings=rope)

    out = []
    for label, keep, offload in (
        ("no checkpoint", None, set()),
        ("keep all", names, set()),
        ("offload all", set(), names),
    ):
        if keep is None:
            backend = "aot_eager"
        else:
            backend = sc.make_sac_backend(keep, offload=offload, inner="aot_eager")
        report = sc.inspection.capture_partition(run, x, backend=backend)
        device = {k: v for k, v in report.bytes_by_region().items() if k not in ("param", "input", "rng")}
        out.append((label, device, report.offloaded_bytes_by_region()))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args(argv)
    print("| layer | configuration | held on the device, B | on the host, B |")
    print("|---|---|---|---|")
    for name, build in (("Llama", tiny_llama), ("Qwen3-MoE", tiny_qwen3_moe)):
        for label, device, host in rows(build, args.hidden, args.batch, args.seq):
            # (the baseline compile reads no regions: its values are unattributed, "-")
            held = ", ".join(f"{k} {v:,}" for k, v in sorted(device.items())) or "-"
            moved = ", ".join(f"{k} {v:,}" for k, v in sorted(host.items())) or "-"
            print(f"| {name} | {label} | {held} | {moved} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
