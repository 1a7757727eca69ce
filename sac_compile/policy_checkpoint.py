"""A wrapped layer traced inside someone else's checkpoint, by a backend without the tagging pass.

Note [a seam inside a checkpoint compiled without the pass]
xtuner wraps each recomputed layer in ``checkpoint_wrapper`` and compiles the wrapper's forward
(``layer.forward = torch.compile(layer.forward, fullgraph=True)``, plain Inductor). With the seam
inside that wrapper, Dynamo traces the seam in the checkpoint's body: its scope markers reach a
graph whose backend never reads them, and the checkpoint recomputes everything (full recompute,
whatever the keep set). There the seam runs its call in a non-reentrant checkpoint of its own
whose ``context_fn`` is PyTorch's selective checkpointing with a policy that reads the region
markers as AOTAutograd traces them: each op gets the layer's region policy's decision for the
regions open around it (``MUST_SAVE`` for a kept region's costly values, recompute otherwise).
PyTorch's partitioner honours those tags under any AOTAutograd backend, and inside the outer
checkpoint (its nodes are tagged by the inner one's policy). What the pass adds beyond the policy
is not applied there: a ``budget`` or ``offload`` (the seam then keeps the outer checkpoint's full
recompute, reported), the kept-nothing and keep-unused checks.

The policy reads the markers in program order, so one policy object serves one trace: the
``context_fn`` makes a new one for each checkpoint call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from ._compat import dynamo
from ._compat.checkpoint import CheckpointPolicy, selective_checkpoint_contexts
from .actions import Actions
from .compiler.backend import SacBackend
from .diagnostics import trace_watch
from .marker_walk import POLICY_SCOPE, MarkerKind, OpenRegions
from .markers.ops import op_marker_kind
from .policy import checked_decision

__all__ = ["applies", "marker_policy_context_fn", "run"]


def applies(scope: str) -> bool:
    """Whether a wrapped layer whose actions' text is ``scope``, traced by Dynamo now, is inside a
    checkpoint's body compiled by a backend without the tagging pass, and has regions to keep
    there (no budget or offload, which the pass alone applies). Called by Dynamo at trace time
    (its result a constant of the trace)."""
    actions = Actions.from_text(scope)
    if not actions.saving:
        return False
    tx = dynamo.current_dynamo_tx()
    if tx is None or not dynamo.traced_inside_checkpoint(tx):
        return False
    backend = dynamo.tx_backend(tx)
    if isinstance(backend, SacBackend) and backend.checkpoint:
        return False
    unkept = [
        what for what, on in (("budget", actions.budget is not None), ("offload", actions.offload)) if on
    ]
    if unkept:
        trace_watch.report_unkept_in_checkpoint(actions.keep, " and ".join(unkept))
        return False
    return True


dynamo.trace_time_constant(applies)


def run(
    call: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    actions: Actions,
    preserve_rng_state: bool,
) -> Any:
    """``call(*args, **kwargs)`` in a non-reentrant checkpoint keeping what ``actions`` keeps by
    the region markers, between scope markers of id :data:`~sac_compile.marker_walk.POLICY_SCOPE`."""
    torch.ops.sac_compile.scope_enter(POLICY_SCOPE, actions.text)
    out = checkpoint(
        functools.partial(call, **kwargs) if kwargs else call,
        *args,
        use_reentrant=False,
        context_fn=marker_policy_context_fn(actions.text),
        preserve_rng_state=preserve_rng_state,
    )
    torch.ops.sac_compile.scope_exit(POLICY_SCOPE, actions.text)
    return out


def marker_policy_context_fn(scope: str) -> functools.partial[Any]:
    """A ``context_fn`` keeping what the scope text ``scope`` (a layer's actions) keeps, by the
    region markers (a partial of a module function over a string: what Dynamo accepts)."""
    return functools.partial(_contexts, scope)


def _contexts(scope: str) -> tuple[Any, Any]:
    return selective_checkpoint_contexts(_MarkerPolicy(Actions.from_text(scope)))


class _MarkerPolicy:
    """PyTorch's selective-checkpoint ``policy_fn``, deciding each op by the regions open around it."""

    def __init__(self, actions: Actions) -> None:
        self.actions = actions
        self.regions = OpenRegions()

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        kind = op_marker_kind(op)
        if kind is not None:
            if kind is MarkerKind.REGION_ENTER:
                self.regions.enter(str(args[0]))
            elif kind is MarkerKind.REGION_EXIT:
                self.regions.exit(str(args[0]))
            return CheckpointPolicy.PREFER_RECOMPUTE
        names = self.regions.names()
        if not names:
            return CheckpointPolicy.PREFER_RECOMPUTE
        decision = checked_decision(self.actions.policy, op, names, self.actions.keep)
        return CheckpointPolicy.PREFER_RECOMPUTE if decision is None else decision
