"""PyTorch's own eager checkpointing, as the benchmarks and the demo compare against it.

:class:`Checkpointed` wraps a layer in ``torch.utils.checkpoint`` (non-reentrant): plain
(full recompute), or PyTorch's selective checkpointing (``create_selective_checkpoint_contexts``)
with a policy function making the eager engine's decisions, read from the same region
markers: ``MUST_SAVE`` for what the region policy saves in the regions open, else
``PREFER_RECOMPUTE``. Against the engine it is the same trade made by PyTorch's machinery,
which intercepts every op of the layer in both passes.
"""

from __future__ import annotations

import functools
from typing import Any, cast

import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ..actions import Actions
from ..eager import EagerSession
from ..keep import KeepSet, normalize_keep
from ..markers import ops
from ..policy import SAVE_COSTLY, RegionPolicy

__all__ = ["Checkpointed", "LayerWrapper"]


class LayerWrapper(nn.Module):
    """A module standing in for ``layer`` (held as ``self.layer``); attributes it lacks are read
    from the layer, as transformers reads attributes of its layers (``attention_type``)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(nn.Module.__getattr__(self, "layer"), name)


class Checkpointed(LayerWrapper):
    """``layer`` under ``torch.utils.checkpoint``: full recompute (``keep=None``), or PyTorch's
    SAC deciding as the eager engine does for ``keep`` (the layer's regions must be declared
    or marked)."""

    def __init__(self, layer: nn.Module, keep: Any = None, policy: RegionPolicy = SAVE_COSTLY) -> None:
        super().__init__(layer)
        self.keep = None if keep is None else normalize_keep(keep)
        self.policy = policy
        self.session: EagerSession | None = None
        self.context_fn = functools.partial(create_selective_checkpoint_contexts, self._decide)

    def _decide(self, ctx, op, *args, **kwargs) -> CheckpointPolicy:
        s = self.session
        if s is not None and s.saves(op, s.open_names()):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    def _run(self, *args, **kwargs):
        # one per forward and per recompute (self.keep is not None: forward runs _run only then)
        self.session = EagerSession(Actions(cast("KeepSet", self.keep), self.policy))
        with ops.marker_sink(self.session):
            return self.layer(*args, **kwargs)

    def forward(self, *args, **kwargs):
        if self.keep is None:
            return checkpoint(self.layer, *args, use_reentrant=False, **kwargs)
        return checkpoint(self._run, *args, use_reentrant=False, context_fn=self.context_fn, **kwargs)
