"""``capture_partition``: compile a function with a sac backend and report its partition.

In the spirit of JAX's ``print_saved_residuals``: compile ``fn`` with a sac
backend (both compile caches disabled, so the tagging pass really runs), run
forward and backward once, and read the partitioned forward/backward graphs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch

from .._compat import dynamo, inductor
from .._compat.checkpoint import tree_leaves
from ..compiler import backend as _backend
from ..compiler import session
from .report import PartitionReport, build_partition

__all__ = ["capture_partition", "fresh_compile"]


class _FreshBackend:
    """A new backend object per capture, so Dynamo cannot reuse an earlier compile."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        return self.inner(gm, example_inputs)


def _resolve_backend(backend: Any) -> _backend.SacBackend:
    if isinstance(backend, _backend.SacBackend):
        return backend
    if backend in ("inductor", "aot_eager"):
        return _backend.baseline_backend(backend)
    raise TypeError(
        f"capture_partition needs a sac backend (sac_compile.sac_backend or "
        f"sac_compile.make_sac_backend(...)), or 'inductor' / 'aot_eager' for the same "
        f"compile without checkpointing; got {backend!r}"
    )


@contextlib.contextmanager
def fresh_compile(
    fn: Callable[..., Any], backend: str | Callable[..., Any], dynamic: bool | None = None
) -> Iterator[Callable[..., Any]]:
    """``fn`` compiled afresh with ``backend`` (a sac backend, ``"inductor"`` / ``"aot_eager"``
    without checkpointing, or any backend callable), for use inside the ``with`` block: both compile caches off (a
    cache hit would skip the tagging pass), a backend object of its own and its own
    ``isolate_recompiles`` bucket, so its cache entries do not count against the
    ``recompile_limit`` of your own ``torch.compile`` calls on ``fn``'s code. ``dynamic``:
    ``torch.compile``'s (``False``: static shapes, even where code compiled before at other
    shapes would be made dynamic)."""
    own = callable(backend) and not isinstance(backend, (str, _backend.SacBackend))
    sac = backend if own else _resolve_backend(backend)
    with contextlib.ExitStack() as stack:
        stack.enter_context(inductor.pass_skipping_caches_disabled())
        stack.enter_context(dynamo.dynamo_config().patch(accumulated_recompile_limit=1 << 20))
        # (torch.compile's typed overloads leave out isolate_recompiles, which it takes)
        yield cast(Any, torch.compile)(
            fn, backend=_FreshBackend(sac), dynamic=dynamic, isolate_recompiles=True
        )


def capture_partition(
    fn: Callable[..., Any], *args: Any, backend: str | Callable[..., Any] | None = None, **kwargs: Any
) -> PartitionReport:
    """Compile ``fn`` with ``backend``, run forward and backward once, report the partition.

    ``backend`` defaults to :data:`sac_compile.sac_backend`. Both compile caches
    are disabled for the capture (a cache hit would skip the tagging pass). The
    capture compiles ``fn`` afresh with its own backend object, in its own
    ``isolate_recompiles`` bucket: its cache entries do not count against the
    ``recompile_limit`` of your own ``torch.compile`` calls (they stay in memory). ``fn``'s output must be a tensor or a
    structure of tensors; backward runs on the sum of its floating-point parts.
    """
    with contextlib.ExitStack() as stack:
        units = stack.enter_context(session.capture_units())
        compiled = stack.enter_context(
            fresh_compile(fn, _backend.sac_backend if backend is None else backend)
        )
        out = compiled(*args, **kwargs)
        loss = _scalar_loss(out)
        if loss is not None and loss.requires_grad:
            torch.autograd.backward(loss)
    report = PartitionReport(output=out)
    for unit in units:
        part = build_partition(len(report.graphs), unit)
        if part is not None:
            report.graphs.append(part)
    return report


def _scalar_loss(out: Any) -> torch.Tensor | None:
    leaves = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    leaves = [t for t in leaves if t.is_floating_point() and t.requires_grad]
    if not leaves:
        return None
    return cast(torch.Tensor, sum(t.sum() for t in leaves))  # (leaves is not empty)
