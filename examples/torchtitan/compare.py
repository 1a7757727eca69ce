"""torchtitan's trainer with sac-compile beside its own activation checkpointing, one run.

    python examples/torchtitan/compare.py                    # 1 process, eager
    python examples/torchtitan/compare.py --compile          # torchtitan compiles each block
    torchrun --nproc-per-node 2 examples/torchtitan/compare.py --tp 2 [--compile]
    python examples/torchtitan/compare.py --model deepseek_v3_mtp   # MoE + MTP (or deepseek_v3, qwen3_moe)
    torchrun --nproc-per-node 2 examples/torchtitan/compare.py --model deepseek_v3 --tp 2 --ep 2

Every configuration is a torchtitan ``Trainer`` built from the same command line (a CPU
debug model of ``cpu.py``: ``--model`` picks Llama-3 (default), DeepSeek-V3 with or without
MTP, or Qwen3-MoE; ``--debug.seed 0``), differing only in activation checkpointing: none,
torchtitan's ``full`` and ``selective``, and the ``sac_compile_ac`` override with several
keep sets (``mlp`` on Llama-3, ``experts`` on the MoE models). ``--ep`` is torchtitan's own
expert parallel (its all-to-all token dispatch); on gloo it runs with TP of the same degree
(FSDP's reduce-scatter needs a reduce op gloo lacks). Each trains ``--steps`` steps on the same batches
(``loss`` is the last step's, ``max |dloss|`` the largest difference from no checkpoint
over all steps), then one more batch measures the bytes held for the backward on this rank
(``sac_compile.inspection.autograd_saved_bytes``: autograd's saves plus what checkpoints hold,
parameters and buffers (the RoPE table) excluded; FSDP's unsharded parameters count only while
they are allocated), then ``--iters`` further steps run interleaved (each round in a
shuffled order) for the step time, a median ratio to no checkpoint with its 95% bootstrap
interval. Compiled, torchtitan's compile uses ``inductor`` for its own policies and
``--compile.backend sac_compile`` for the override (what a user passes).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "benchmarks"))

import cpu  # noqa: E402

MiB = 2**20
SAC = "sac_compile_ac.sac_compile"
#: --model -> the ``cpu.py`` config (torchtitan's debug model, set up for a CPU)
MODELS = {
    "llama3": "llama3_debugmodel_cpu",
    "deepseek_v3": "deepseek_v3_debugmodel_cpu",
    "deepseek_v3_mtp": "deepseek_v3_debugmodel_mtp_cpu",
    "qwen3_moe": "qwen3_moe_debug_cpu",
}
CONFIGS = {
    "no checkpoint": ["activation-checkpoint:none"],
    "torchtitan full": ["activation-checkpoint:full"],
    "torchtitan selective": [],  # the debug config's own choice
    "sac keep {} (full)": ["--override.imports", SAC + '={"keep": []}'],
    "sac keep attn": ["--override.imports", SAC + '={"keep": ["attn"]}'],
    "sac keep mlp": ["--override.imports", SAC + '={"keep": ["mlp"]}'],
    "sac keep attn+mlp": ["--override.imports", SAC + '={"keep": ["attn", "mlp"]}'],
    # the MLP's values to host memory instead (on a CPU the host is the device: attn+mlp's bytes)
    "sac keep attn (offload mlp)": ["--override.imports", SAC + '={"keep": ["attn"], "offload": ["mlp"]}'],
    # MoE models (--model deepseek_v3, deepseek_v3_mtp, qwen3_moe): the routed experts
    "sac keep experts": ["--override.imports", SAC + '={"keep": ["experts"]}'],
    "sac keep attn+experts": ["--override.imports", SAC + '={"keep": ["attn", "experts"]}'],
    # --compile only: the seam compiles each block (make_sac_backend), torchtitan's compile is off
    # (the way for a FlexAttention model, for which torchtitan refuses a backend by name)
    "sac keep attn (seam compiles)": ["--override.imports", SAC + '={"keep": ["attn"], "compile": true}'],
}
SEAM_COMPILES = "sac keep attn (seam compiles)"
#: --inner aot_eager: the name the override's blocks compile with (registered by main: sac-compile's
#: backend reading each block's keep set, AOTAutograd without Inductor's code generation)
AOT_EAGER_BACKEND = "sac_compile_aot_eager"
DENSE_ONLY = {"sac keep mlp", "sac keep attn+mlp", "sac keep attn (offload mlp)"}
MOE_ONLY = {"sac keep experts", "sac keep attn+experts"}


def _argv(name: str, args: argparse.Namespace) -> list[str]:
    argv = ["--module", "cpu", "--config", MODELS[args.model], "--debug.seed", "0"]
    argv += ["--training.steps", str(args.steps + args.iters + 2), "--metrics.log-freq", "1000000"]
    argv += ["--training.seq-len", str(args.seq_len), "--training.local-batch-size", str(args.batch)]
    if args.tp > 1:
        argv += [
            "--parallelism.tensor-parallel-degree",
            str(args.tp),
            "--parallelism.spmd-backend",
            "full_dtensor",
        ]
    if args.ep > 1:  # torchtitan's own expert parallel (all-to-all token dispatch over gloo)
        argv += ["--parallelism.expert-parallel-degree", str(args.ep), "--training.disable-cuda-graphs"]
    if args.compile and name != SEAM_COMPILES:
        argv += ["--compile.enable", "--compile.components", "model"]
        if name.startswith("sac"):
            argv += ["--compile.backend", "sac_compile" if args.inner == "inductor" else AOT_EAGER_BACKEND]
        elif args.inner != "inductor":
            argv += ["--compile.backend", args.inner]
    return argv + CONFIGS[name]  # a tyro subcommand (activation-checkpoint:...) goes last


class Run:
    """One configuration's trainer, its batches and what it measured."""

    def __init__(self, name: str, args: argparse.Namespace):
        from torchtitan.config import ConfigManager

        self.name = name
        self.trainer = ConfigManager().parse_args(_argv(name, args)).build()
        self.batches = self.trainer.batch_generator(self.trainer.dataloader)
        self.losses: list[float] = []
        self.graphs = 0  # graphs Dynamo compiled during this trainer's steps
        self.recording = False
        forward_backward = self.trainer.forward_backward_step

        def recorded(**kwargs):
            loss = forward_backward(**kwargs)
            if self.recording:
                self.losses.append(float(_whole(loss.detach())))
            return loss

        self.trainer.forward_backward_step = recorded

    def step(self, record: bool = False) -> None:
        from torch._dynamo.utils import counters

        self.trainer.step += 1
        self.recording = record
        before = counters["stats"]["unique_graphs"]
        self.trainer.train_step(self.batches)
        self.graphs += counters["stats"]["unique_graphs"] - before

    def held_bytes(self) -> int:
        import sac_compile as sc

        trainer = self.trainer
        input_dict, labels = next(self.batches)
        input_dict = {k: v.to(trainer.device) for k, v in input_dict.items()}
        inputs, labels, extra = trainer.post_dataloading_process(input_dict, labels.to(trainer.device))
        tokens = (labels != -100).sum()
        model = trainer.model_parts[0]

        # as the trainer calls it: MTPLoss needs the positions (torchtitan's trainer.py)
        loss_kwargs = {"positions": extra["positions"]} if "positions" in extra else {}

        def loss():
            with trainer.train_context():  # as the trainer runs it (its mesh context: no recompile)
                out, _ = trainer.loss_fn(model(inputs, **extra), labels, tokens, **loss_kwargs)
            return _whole(out)

        # no warm-up call once the trainer has run its steps (and so compiled)
        params = [*model.parameters(), *model.buffers()]
        held = sc.inspection.autograd_saved_bytes(loss, exclude=params, warmup=trainer.step == 0)
        trainer.optimizers.zero_grad()
        return held


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="llama3", choices=list(MODELS), help="torchtitan's debug model")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (launch that many ranks)")
    parser.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel degree (MoE models; on gloo: with --tp of the same degree)",
    )
    parser.add_argument("--compile", action="store_true", help="torchtitan compiles each block")
    parser.add_argument(
        "--inner",
        default="inductor",
        choices=("inductor", "aot_eager"),
        help="--compile: what compiles the partitioned graphs (aot_eager: the same partitions, no codegen)",
    )
    parser.add_argument("--steps", type=int, default=4, help="training steps whose losses are compared")
    parser.add_argument(
        "--iters", type=int, default=15, help="interleaved timed steps per configuration (0: none)"
    )
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument(
        "--layers",
        type=int,
        default=None,
        help="N layers: the first N of the debug model's 6, or more (copies of the last)",
    )
    parser.add_argument("--configs", default=None, help="comma-separated subset of: " + ", ".join(CONFIGS))
    parser.add_argument("--json", default=None, help="also write the figures to this file (rank 0)")
    args = parser.parse_args(argv)
    moe = args.model != "llama3"
    if args.configs is None:
        skip = {SEAM_COMPILES} if not args.compile else set()
        skip |= DENSE_ONLY if moe else MOE_ONLY
        args.configs = ",".join(n for n in CONFIGS if n not in skip)
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    if SEAM_COMPILES in names and not args.compile:
        parser.error(f"'{SEAM_COMPILES}' is a compiled configuration: add --compile")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"unknown configurations {unknown}; choose from {list(CONFIGS)}")

    if args.ep > 1 and (not moe or args.tp != args.ep):
        parser.error(
            "--ep needs an MoE --model and --tp of the same degree (FSDP over gloo cannot reduce-scatter)"
        )
    if args.layers is not None:  # read by cpu.py's configs
        os.environ[cpu.LAYERS_ENV] = str(args.layers)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != args.tp:
        parser.error(
            f"--tp {args.tp} needs {args.tp} ranks (torchrun --nproc-per-node {args.tp}); WORLD_SIZE={world}"
        )
    cpu.prepare()
    import torch
    import torch.distributed as dist
    from _timing import interleaved_times, ratio_interval

    # Seven trainers in one process compile the same block code (CheckpointWrapper.forward)
    # once per policy and backend: more cache entries than Dynamo's default limit of 8,
    # which a training process with one trainer never reaches.
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.accumulated_recompile_limit = 1024
    if args.inner == "aot_eager":
        import sac_compile as sc

        torch._dynamo.register_backend(sc.make_sac_backend(inner="aot_eager"), name=AOT_EAGER_BACKEND)
    _share_parallel_dims()
    runs = [Run(name, args) for name in names]
    rank = dist.get_rank()
    for _ in range(args.steps):
        for run in runs:
            run.step(record=True)
    held = {run.name: run.held_bytes() for run in runs}
    # --iters 0: no timed steps (the tests read losses and bytes only)
    times = interleaved_times({run.name: run.step for run in runs}, args.iters) if args.iters else {}
    for run in runs:
        run.trainer.close()

    base = names[0]
    med = {k: statistics.median(v) for k, v in times.items()}
    results = {}
    for run in runs:
        lo, hi = (
            ratio_interval(times, lambda m, k=run.name: m[k] / m[base]) if times else (math.nan, math.nan)
        )
        results[run.name] = {
            "losses": run.losses,
            "max_dloss": max(abs(a - b) for a, b in zip(run.losses, runs[0].losses)),
            "held_bytes": held[run.name],
            "graphs": run.graphs,
            "step_ratio": med[run.name] / med[base] if times else math.nan,
            "step_interval": [lo, hi],
        }
    if rank == 0:
        mode = "compiled (torchtitan's per-block compile)" if args.compile else "eager"
        print(
            f"\ntorchtitan {_version()} {MODELS[args.model]} on CPU, torch {torch.__version__}, {mode}, "
            f"TP={args.tp}, EP={args.ep}, batch {args.batch} x seq {args.seq_len}; held = this rank's bytes "
            f"for the backward; step = median of {args.iters} interleaved steps / '{base}'\n"
        )
        print(
            f"| configuration | loss (step {args.steps}) | max abs dloss | held MiB | vs none | step (95%) |"
        )
        print("|---|---:|---:|---:|---:|---:|")
        for name, r in results.items():
            lo, hi = r["step_interval"]
            print(
                f"| {name} | {r['losses'][-1]:.5f} | {r['max_dloss']:.1e} | {r['held_bytes'] / MiB:.3f} | "
                f"{r['held_bytes'] / results[base]['held_bytes']:.2f} | {r['step_ratio']:.2f}x ({lo:.2f}-{hi:.2f}) |"
            )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return results


def _whole(t):
    """A DTensor loss (tensor parallel) as a plain tensor."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _share_parallel_dims() -> None:
    """Every trainer of this process uses the first one's ``ParallelDims`` (its device meshes).

    One trainer per process is what torchtitan expects: a second one building meshes of its
    own gets parameters on a mesh that is not the one ``fully_shard`` is handed (under
    ``spmd_backend=full_dtensor``: "Expected param's DTensor mesh to be the same mesh").
    """
    from torchtitan.trainer import Trainer

    build = Trainer.init_distributed
    shared = []

    def init_distributed(self):
        if not shared:
            shared.append(build(self))
        return shared[0]

    Trainer.init_distributed = init_distributed


def _version() -> str:
    from importlib.metadata import version

    return version("torchtitan")


if __name__ == "__main__":
    main()
