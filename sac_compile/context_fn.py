"""``region_context_fn``: the regions as a ``torch.utils.checkpoint`` ``context_fn``.

For code that already calls ``torch.utils.checkpoint.checkpoint`` itself (transformers'
own activation checkpointing, a training framework's wrapper)::

    checkpoint(layer, x, use_reentrant=False, context_fn=sac_compile.region_context_fn(keep={"attn"}))

keeps the marked regions in ``keep`` of that checkpoint, eagerly and under
``torch.compile``, with the seam's semantics:

* eagerly, the two contexts are the eager engine's forward pass and recompute pass
  (:func:`sac_compile.eager.engine_contexts`): exactly what the seam runs;
* while AOTAutograd traces the checkpoint (``torch.compile``: a proxy mode is active,
  PyTorch's own test for "compiling" in ``torch/utils/checkpoint.py``), they are
  PyTorch's selective-checkpoint modes with everything preferring recompute, as for a
  plain checkpoint, and the forward's is bracketed by scope markers carrying the keep
  set, policy and budget. The tagging pass then decides the checkpoint's nodes as it
  decides a wrapped layer's. A backend without the pass (plain Inductor) gets a full
  recompute, and the markers are reported (diagnosis 3).

What ``region_context_fn`` returns is a ``functools.partial`` of a module-level function
over a string and two bools: Dynamo accepts only a function or a partial as a
``context_fn`` (and guards on its constant arguments), and the partial pickles (a
``TrainingArguments`` holding it is saved with the trainer's state).
"""

from __future__ import annotations

import functools
from contextlib import AbstractContextManager
from typing import Any, NoReturn

import torch

from ._compat.checkpoint import (
    CheckpointPolicy,
    TorchDispatchMode,
    checkpoint_is_traced,
    selective_checkpoint_contexts,
)
from ._compat.frames import innermost_module
from .actions import Actions
from .arguments import check_bool
from .diagnostics import eager as diagnosed
from .eager import engine_contexts
from .keep import Keep, Regions
from .policy import SAVE_COSTLY, RegionPolicy
from .records import user_class_name

__all__ = ["region_context_fn"]


def region_context_fn(
    keep: Keep = (),
    *,
    policy: RegionPolicy = SAVE_COSTLY,
    budget: float | None = None,
    offload: Regions = (),
    preserve_rng_state: bool = True,
    early_stop: bool = True,
) -> functools.partial[Any]:
    """A ``context_fn`` for a non-reentrant ``torch.utils.checkpoint`` keeping the regions
    in ``keep`` as ``policy`` decides (see the module docstring).

    ``keep``, ``policy``, ``budget`` and ``offload`` mean what they mean for
    :func:`~sac_compile.apply_selective_checkpointing` (``budget`` only under
    ``torch.compile``: the eager engine raises). ``preserve_rng_state`` and ``early_stop``
    must be the values the checkpoint itself is called with (both default ``True``, as
    the checkpoint's): the engine replays random ops and stops its recompute as the
    checkpoint does.
    """
    actions = Actions.of(keep, policy, budget, offload)
    check_bool(preserve_rng_state, "region_context_fn: preserve_rng_state")
    check_bool(early_stop, "region_context_fn: early_stop")
    return functools.partial(_region_contexts, actions.text, preserve_rng_state, early_stop)


def _region_contexts(
    scope: str, preserve_rng_state: bool, early_stop: bool
) -> tuple[AbstractContextManager[Any], AbstractContextManager[Any]]:
    """The two contexts of one checkpoint call (``scope``: the scope markers' text)."""
    if checkpoint_is_traced():
        forward, recompute = selective_checkpoint_contexts(_prefer_recompute)
        return _ScopeMarked(forward, scope), recompute
    actions = Actions.from_text(scope)
    keep = actions.saving
    module = innermost_module()  # the module whose method called the checkpoint
    who = type(module).__name__ if module is not None else "a checkpoint"
    actions.refuse_budget_eagerly(f"{who}'s region_context_fn", "Compile the model")
    on_forward = None
    if module is not None and not diagnosed.engine_done(module, keep):
        on_forward = functools.partial(diagnosed.check_engine_call, module, keep)
    where = (user_class_name(type(module)) if module is not None else "", "")
    _, forward, recompute = engine_contexts(
        actions, preserve_rng_state, early_stop, on_forward=on_forward, where=where
    )
    return forward, recompute


def _prefer_recompute(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE


class _ScopeMarked(TorchDispatchMode):
    """PyTorch's caching mode (``inner``), bracketed by scope markers when entered.

    Never pushed itself: entering it emits ``scope_enter`` (recorded by the proxy mode
    below, so it lands in the joint graph before the checkpoint's first op), enters
    ``inner``, and on exit the reverse. ``ac_graph_id``, which the checkpoint's compiled
    implementation sets on its forward context, goes to ``inner``. Scope id 0: a scope
    of its own, not a layer compiled on its own (see ``seam_scope_args``)."""

    def __init__(self, inner: Any, scope: str) -> None:  # (torch's _CachingTorchDispatchMode)
        super().__init__()
        self.inner = inner
        self.scope = scope

    @property
    def ac_graph_id(self) -> Any:
        return self.inner.ac_graph_id

    @ac_graph_id.setter
    def ac_graph_id(self, value: Any) -> None:
        self.inner.ac_graph_id = value

    def __enter__(self) -> _ScopeMarked:
        torch.ops.sac_compile.scope_enter(0, self.scope)
        self.inner.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.inner.__exit__(*exc)
        torch.ops.sac_compile.scope_exit(0, self.scope)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> NoReturn:  # never pushed
        raise AssertionError("_ScopeMarked is entered through its inner mode only")
