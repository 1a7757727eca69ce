"""sac-compile as torchtitan's activation checkpointing, through its override mechanism.

torchtitan builds its activation checkpointing from ``Trainer.Config.activation_checkpoint``
(``selective``, ``full``, ``memory-budget``: subclasses of ``ActivationCheckpointing``)
and wraps each ``TransformerBlock`` of ``model.layers`` with ``_wrap_block`` after tensor
parallelism, before ``torch.compile`` and FSDP. ``--override.imports`` swaps that config
node for another ``Configurable`` (torchtitan's ``@override``): here ``SacCompileAC``,
whose ``_wrap_block`` declares regions on the block by module path and wraps it with
``sac_compile.apply_selective_checkpointing``; its ``apply`` also wraps the multi-token
prediction layers (``model.mtp_layers``), which torchtitan's own policies leave out. Put this folder on ``PYTHONPATH`` and::

    torchrun ... -m torchtitan.train --module llama3 --config llama3_debugmodel \\
        --override.imports 'sac_compile_ac.sac_compile={"keep": ["attn"]}'

The override replaces whichever policy the config selected (the debug configs select
``selective``). Its keyword arguments (JSON after ``=``) are the fields of
``SacCompileAC.Config``: ``keep`` (region names, ``[]`` for full recompute, ``"all"`` for
every region), ``regions`` (``{path in the block: region name}``; default: ``attention`` is
``attn``, ``feed_forward`` is ``mlp``, an MoE block's ``moe.router`` / ``moe.routed_experts`` /
``moe.shared_experts`` are ``router`` / ``experts`` / ``shared_experts``, each block declaring
those it has), ``policy`` (``"save_costly"`` or ``"save_all"``), ``budget``
(compiled only) and ``compile`` (the seam compiles each block itself: see below).

Compiled, with SDPA attention: ``--compile.enable --compile.backend sac_compile``
(torchtitan compiles each block with the backend of that name, which reads the keep set the
block's scope carries). torchtitan refuses a backend other than ``inductor`` / ``aot_eager``
for a FlexAttention model; there, pass ``"compile": true`` here and leave the model out of
torchtitan's compile (no ``--compile.enable``, or ``--compile.components loss``). A block
compiled by a backend without sac-compile's pass is reported (``no-pass``, logger
``sac_compile``), not silently left uncheckpointed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torchtitan.config import derive, override
from torchtitan.distributed.activation_checkpoint import ActivationCheckpointing
from torchtitan.tools.logging import logger

import sac_compile as sc

# torchtitan 0.3.0's blocks: ``attention`` and ``feed_forward`` (dense), or an MoE block
# (models/common/moe.py: DeepSeek-V3, Qwen3-MoE, ...) with ``moe.router``,
# ``moe.routed_experts`` (the grouped-mm experts and their token dispatch: all-to-alls under
# expert parallelism) and ``moe.shared_experts``. Each block declares the ones it has, so a
# dense first layer and the MoE layers after it each get theirs.
DEFAULT_REGIONS = {
    "attention": "attn",
    "feed_forward": "mlp",
    "moe.router": "router",
    "moe.routed_experts": "experts",
    "moe.shared_experts": "shared_experts",
}
_POLICIES = {"save_costly": sc.SAVE_COSTLY, "save_all": sc.SAVE_ALL}


class SacCompileAC(ActivationCheckpointing):
    """Region-level selective checkpointing of each block (``sac_compile``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ActivationCheckpointing.Config):
        keep: list[str] | str = field(default_factory=lambda: ["attn"])
        """Region names to keep (save): ``[]`` is full recompute, ``"all"`` every region."""

        regions: dict[str, str] = field(default_factory=dict)
        """``{module path inside the block: region name}``; empty: the defaults that exist."""

        policy: str = "save_costly"
        """``save_costly`` (a kept region's matmuls, attention, ... saved) or ``save_all``."""

        budget: float | None = None
        """Knapsack budget after the kept values (compiled blocks only)."""

        offload: list[str] = field(default_factory=list)
        """Region names whose saved values go to host memory and come back for the backward."""

        compile: bool = False
        """Compile each block here, with ``make_sac_backend(keep)`` (see the module docstring)."""

    def __init__(self, config: SacCompileAC.Config, dump_folder: str = ""):
        super().__init__(config, dump_folder)
        if config.debug or config.determinism_check != "default":
            raise ValueError(
                "SacCompileAC does not use activation_checkpoint.debug or .determinism_check "
                f"(got debug={config.debug}, determinism_check={config.determinism_check!r}): "
                "sac-compile's recompute checks ops itself; leave them at their defaults"
            )
        if config.policy not in _POLICIES:
            raise ValueError(f"SacCompileAC policy={config.policy!r}: expected one of {sorted(_POLICIES)}")
        if isinstance(config.keep, str) and config.keep != "all":
            raise ValueError(f"SacCompileAC keep={config.keep!r}: a list of region names, [] or 'all'")
        self._keep = sc.ALL_REGIONS if config.keep == "all" else tuple(config.keep)
        # keep, offload, policy and budget checked together now, as the seam checks them
        sc.make_sac_backend(
            self._keep, policy=_POLICIES[config.policy], budget=config.budget, offload=config.offload
        )

    def regions_for(self, block: nn.Module) -> dict[str, str]:
        """The regions declared on ``block``: the configured ones, else the defaults it has."""
        if self.config.regions:
            return dict(self.config.regions)
        paths = {name for name, _ in block.named_modules()}
        return {path: name for path, name in DEFAULT_REGIONS.items() if path in paths}

    def apply(self, model: nn.Module) -> None:
        """torchtitan's ``apply`` wraps every block of ``model.layers``; the multi-token
        prediction layers (``model.mtp_layers`` of DeepSeek-V3's MTP configs), which
        torchtitan's own policies leave out, are wrapped here too."""
        super().apply(model)
        mtp = getattr(model, "mtp_layers", None)
        if mtp is not None:
            for index, block in list(mtp.named_children()):
                mtp.register_module(index, self._wrap_block(block, base_fqn=f"mtp_layers.{index}"))
            logger.info(f"sac-compile: checkpointed the {len(mtp)} MTP layer(s) (mtp_layers) too")

    def _wrap_block(self, module: nn.Module, *, base_fqn: str | None = None) -> nn.Module:
        config = self.config
        regions = self.regions_for(module)
        sc.declare_regions(module, regions)  # strict: a path the block lacks is a ValueError
        sc.apply_selective_checkpointing(
            module,
            keep=self._keep,
            policy=_POLICIES[config.policy],
            budget=config.budget,
            offload=config.offload,
            preserve_rng_state=config.preserve_rng_state,
            compile={"fullgraph": True} if config.compile else False,
        )
        if base_fqn in (None, "layers.0"):
            logger.info(
                f"sac-compile: {base_fqn or 'block'} regions {regions}, keep {sc_keep_text(self._keep)}"
            )
        # Wrapped as torchtitan's own policies wrap a block (a CheckpointWrapper: the same
        # module paths and state_dict keys as theirs), so FSDP's hooks and torchtitan's
        # per-block compile sit outside the seam: Dynamo compiles the wrapper's forward
        # (the seam inside it emits its scope), not FSDP's hooks, which it cannot trace.
        return checkpoint_wrapper(module, checkpoint_fn=_call)


def _call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return module(*args, **kwargs)  # the seam inside ``module`` checkpoints it


def sc_keep_text(keep: Any) -> str:
    return (
        "every region" if keep is sc.ALL_REGIONS else ("{" + ", ".join(keep) + "}" if keep else "{} (full)")
    )


@override(target=ActivationCheckpointing.Config, description="sac-compile region checkpointing")
def sac_compile(config: ActivationCheckpointing.Config, **fields: Any) -> SacCompileAC.Config:
    """``--override.imports 'sac_compile_ac.sac_compile={"keep": [...], ...}'``."""
    return derive(config, SacCompileAC.Config, **fields)
