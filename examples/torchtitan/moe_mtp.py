"""torchtitan's DeepSeek-V3 with MTP, checkpointed by the plugin: every block, MTP layers too.

    python examples/torchtitan/moe_mtp.py [--layers 3] [--seq-len 64] [--json PATH]

torchtitan 0.3.0's ``deepseek_v3`` debug model with one multi-token-prediction layer
(``model_registry("debugmodel", num_mtp_layers=1)``: a dense first block, then MoE blocks with
``moe.router``, ``moe.routed_experts`` and ``moe.shared_experts``; the MTP block has an MoE
too), SDPA attention (FlexAttention has no CPU backward here), built on the CPU with
torchtitan's own initialisation. Each configuration is applied with torchtitan's ``apply``
(the plugin's ``SacCompileAC``, or torchtitan's ``FullAC``), then one forward and backward
with ``MTPLoss`` on the same batch: the loss, the largest gradient difference from no
checkpoint (canonical parameter names), and the bytes held for the backward
(``sac_compile.inspection.autograd_saved_bytes``, parameters and buffers excluded).
torchtitan's ``FullAC`` wraps ``model.layers`` only; the plugin wraps ``model.mtp_layers``
too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import cpu  # noqa: E402

MiB = 2**20
CONFIGS = {  # name -> the plugin's keep, or None (no checkpoint) / "torchtitan full"
    "no checkpoint": None,
    "torchtitan full": "torchtitan full",
    "sac keep {} (full)": [],
    "sac keep experts": ["experts"],
    "sac keep attn+experts": ["attn", "experts"],
    "sac keep every region": "all",
}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--layers", type=int, default=3, help="keep the first N of the debug model's 6 blocks"
    )
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args(argv)
    cpu.install()
    import sac_compile_ac as plugin
    import torch
    from torchtitan.distributed.activation_checkpoint import FullAC
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.deepseek_v3 import model_registry
    from torchtitan.models.deepseek_v3.mtp import MTPLoss

    import sac_compile as sc

    spec = model_registry("debugmodel", num_mtp_layers=1).model
    del spec.layers[args.layers :]
    for block in [*spec.layers, *spec.mtp_layers]:
        block.attention.inner_attention = ScaledDotProductAttention.Config()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 2048, (args.batch, args.seq_len), generator=g)
    labels = torch.randint(0, 2048, (args.batch, args.seq_len), generator=g)
    positions = torch.arange(args.seq_len).repeat(args.batch, 1)
    loss_fn = MTPLoss(MTPLoss.Config(global_vocab_size=2048))

    def run(keep) -> dict:
        torch.manual_seed(0)
        with torch.device("meta"):
            model = spec.build()
        model.to_empty(device="cpu")
        with torch.no_grad():
            model.init_weights(buffer_device=None)
        model.train()
        if keep == "torchtitan full":
            FullAC(FullAC.Config()).apply(model)
        elif keep is not None:
            plugin.SacCompileAC(plugin.SacCompileAC.Config(keep=keep)).apply(model)

        def loss():
            return loss_fn(
                model(tokens, positions, None), labels, torch.tensor(tokens.numel()), positions=positions
            )[0]

        held = sc.inspection.autograd_saved_bytes(loss, exclude=[*model.parameters(), *model.buffers()])
        value = loss()
        value.backward()
        grads = {
            n.replace("._checkpoint_wrapped_module", ""): p.grad
            for n, p in model.named_parameters()
            if p.grad is not None
        }
        wrapped = sorted(p for p, m in model.named_modules() if type(m).__name__ == "CheckpointWrapper")
        return {"loss": value.item(), "held_bytes": held, "grads": grads, "wrapped": wrapped}

    runs = {name: run(keep) for name, keep in CONFIGS.items()}
    base = runs["no checkpoint"]["grads"]
    results = {}
    for name, r in runs.items():
        assert r["grads"].keys() == base.keys(), name
        results[name] = {
            "loss": r["loss"],
            "max_dgrad": max((r["grads"][k] - base[k]).abs().max().item() for k in base),
            "held_bytes": r["held_bytes"],
            "wrapped": r["wrapped"],
        }
    none = results["no checkpoint"]["held_bytes"]
    print(
        f"\ntorchtitan DeepSeek-V3 debug model + 1 MTP layer ({args.layers} blocks), CPU, torch "
        f"{torch.__version__}, batch {args.batch} x seq {args.seq_len}; held = bytes for the backward\n"
    )
    print("| configuration | loss | max abs dgrad | held MiB | vs none | checkpointed |")
    print("|---|---:|---:|---:|---:|---|")
    for name, r in results.items():
        blocks = [w for w in r["wrapped"] if w.startswith("layers.")]
        mtp = [w for w in r["wrapped"] if w.startswith("mtp_layers.")]
        where = f"{len(blocks)} blocks" + (f" + {len(mtp)} MTP" if mtp else "") if r["wrapped"] else "-"
        print(
            f"| {name} | {r['loss']:.6f} | {r['max_dgrad']:.1e} | {r['held_bytes'] / MiB:.2f} | "
            f"{r['held_bytes'] / none:.2f} | {where} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
