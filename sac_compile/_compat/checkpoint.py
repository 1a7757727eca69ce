"""``torch.utils.checkpoint``'s selective-checkpointing internals, autograd's saved-tensor
hooks, Python dispatch modes and pytree helpers, as the eager engine uses them.

The engine is modelled on PyTorch's ``_CachingTorchDispatchMode`` /
``_CachedTorchDispatchMode``; where upstream exposes the pieces it shares
(the ignored-op set, the per-op storage key, version-checked detached aliases)
we use upstream's, so fixes there reach us.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.utils.checkpoint
from torch.multiprocessing.reductions import StorageWeakRef

# Public: the partitioner's and SAC's tag values.
from torch.utils.checkpoint import CheckpointPolicy

from . import private

__all__ = [
    "CheckpointPolicy",
    "TorchDispatchMode",
    "VersionWrapper",
    "detach_helper",
    "sac_ignored_ops",
    "sac_storage_key",
    "top_saved_tensors_hooks",
    "checkpoint_early_stop",
    "checkpoint_is_traced",
    "selective_checkpoint_contexts",
    "checkpoint_internal_hooks",
    "dynamo_free",
    "mark_dynamo_free",
    "pop_dispatch_mode",
    "pop_hooks",
    "pop_saved_tensors_hooks",
    "push_dispatch_mode",
    "push_hooks",
    "push_saved_tensors_hooks",
    "storage_holders",
    "tree_leaves",
    "tree_map",
    "map_inner",
    "stand_in_maker",
    "storage_tensor",
]

# torch.utils._python_dispatch.TorchDispatchMode: the base class of dispatch modes
# (private module, the documented way to write one).
if TYPE_CHECKING:

    class TorchDispatchMode:
        """The typed face of torch's class (unannotated there): what our modes use of it."""

        supports_higher_order_operators: bool

        def __init__(self) -> None: ...
        def __enter__(self) -> Any: ...
        def __exit__(self, *exc: object) -> None: ...
        def __torch_dispatch__(
            self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
        ) -> Any: ...

else:
    TorchDispatchMode = private("torch.utils._python_dispatch", "TorchDispatchMode")
# A cached value as SAC stores it: a detached alias wrapped with the version counter it
# had when cached (get_val raises if it was written in place since).
VersionWrapper = private("torch.utils.checkpoint", "_VersionWrapper")
detach_helper = private("torch.utils.checkpoint", "_detach_helper")


def sac_ignored_ops() -> frozenset[Any]:
    """Ops SAC neither caches nor counts (``torch.utils.checkpoint.SAC_IGNORED_OPS``: detach,
    ``prim.device`` and ``FunctionalTensor.metadata_fns``, which checkpoint's own checks may
    run a different number of times in the forward and the recompute)."""
    return frozenset(private("torch.utils.checkpoint", "SAC_IGNORED_OPS"))


_STORAGE_KEY = getattr(torch.utils.checkpoint, "_sac_storage_key", None)


def sac_storage_key(func: Any, args: tuple[Any, ...]) -> Any:
    """The key of ``func``'s per-op FIFO of cached values (``_sac_storage_key``): the op,
    except that each Inductor-compiled region called as ``inductor_compiled_code`` gets its
    own queue (upstream gh-175258: one shared queue served the wrong entry when a cached
    region was skipped in the recompute). Torch without it: the op."""
    return func if _STORAGE_KEY is None else _STORAGE_KEY(func, args)


def checkpoint_early_stop(early_stop: bool = True) -> bool:
    """Whether a non-reentrant checkpoint called now with ``early_stop`` stops its recompute
    once the last saved tensor is rebuilt: ``set_checkpoint_early_stop``, when in effect,
    overrides the argument (``_enable_checkpoint_early_stop``, None when not set)."""
    flag = getattr(torch.utils.checkpoint, "_enable_checkpoint_early_stop", None)
    return bool(early_stop) if flag is None else bool(flag)


_is_compiling = private("torch.utils.checkpoint", "_is_compiling")
_TRACING_MODES = (torch._C._TorchDispatchModeKey.FAKE, torch._C._TorchDispatchModeKey.FUNCTIONAL)


def checkpoint_is_traced() -> bool:
    """Whether a checkpoint called now runs inside AOTAutograd (``torch.compile``): PyTorch's
    own test (``torch.utils.checkpoint._is_compiling``: a proxy mode is active, so its
    ``context_fn`` must return dispatch modes), or a fake or functional tensor mode is active
    (AOTAutograd's metadata pass runs the graph with fake tensors and no proxy mode; the
    eager engine must not run there)."""
    if _is_compiling(None, (), {}):
        return True
    return any(torch._C._get_dispatch_mode(key) is not None for key in _TRACING_MODES)


# Public: PyTorch's selective-checkpoint context pair (a caching and a cached dispatch mode).
def selective_checkpoint_contexts(policy: Callable[..., Any]) -> tuple[Any, Any]:
    """``create_selective_checkpoint_contexts(policy)``: the caching (forward) and cached
    (recompute) contexts."""
    pair: tuple[Any, Any] = torch.utils.checkpoint.create_selective_checkpoint_contexts(policy)  # type: ignore[no-untyped-call]
    return pair


def top_saved_tensors_hooks() -> tuple[Any, Any] | None:
    """The innermost ``saved_tensors_hooks`` pair in effect (the checkpoint's own, inside
    a non-reentrant checkpoint), or None (``torch._C._autograd``)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


@contextlib.contextmanager
def checkpoint_internal_hooks(pack: Callable[..., Any], unpack: Callable[..., Any]) -> Iterator[None]:
    """``saved_tensors_hooks(pack, unpack)`` that a checkpoint nested inside takes for the
    checkpoint's own, not the user's.

    Since torch 2.15 selective checkpointing routes the tensors it caches through the
    *user's* saved-tensors hooks (``respect_saved_tensors_hooks``; a ``FutureWarning`` while
    it defaults to off), found by ``_current_user_saved_tensors_hooks``, which skips pack
    hooks marked ``_checkpoint_internal`` and follows their ``_user_hooks`` to the pair that
    was in effect below them (``torch/utils/checkpoint.py``). Our pack hook wraps the
    checkpoint's own, so it is marked the same way; before 2.15 the marks are unread.
    """
    current = getattr(torch.utils.checkpoint, "_current_user_saved_tensors_hooks", None)
    if current is not None:
        pack._checkpoint_internal = True  # type: ignore[attr-defined]
        pack._user_hooks = current()  # type: ignore[attr-defined]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
    finally:
        if current is not None:
            del pack._user_hooks  # type: ignore[attr-defined]  # (upstream: no reference cycle)


# The saved-tensors hook stack (torch._C._autograd): what saved_tensors_hooks pushes and
# pops. A kept module whose body skips the recompute (eager/kept_bodies.py) runs with the
# checkpoint's hooks taken off the stack, so that autograd saves inside it as without
# checkpointing; there is no public way to step out of an enclosing hooks context.
_autograd_c = torch._C._autograd


def pop_saved_tensors_hooks(n: int) -> list[tuple[Callable[..., Any], Callable[..., Any]]]:
    """Pop the ``n`` innermost saved-tensors hook pairs; returned innermost first."""
    popped = []
    for _ in range(n):
        top = _autograd_c._top_saved_tensors_default_hooks(False)
        if top is None:
            break
        _autograd_c._pop_saved_tensors_default_hooks()
        popped.append(top)
    return popped


def push_saved_tensors_hooks(pairs: list[tuple[Callable[..., Any], Callable[..., Any]]]) -> None:
    """Push back what :func:`pop_saved_tensors_hooks` popped (innermost last)."""
    for pack, unpack in reversed(pairs):
        _autograd_c._push_saved_tensors_default_hooks(pack, unpack)


def push_hooks(pack: Callable[..., Any], unpack: Callable[..., Any]) -> None:
    _autograd_c._push_saved_tensors_default_hooks(pack, unpack)


def pop_hooks() -> None:
    _autograd_c._pop_saved_tensors_default_hooks()


# torch.utils._pytree: flattening op arguments and outputs (no public equivalent in 2.13).
tree_leaves = private("torch.utils._pytree", "tree_leaves")
tree_map = private("torch.utils._pytree", "tree_map")


# Note [a dispatch mode pushed per kept span]
# The eager engine pushes its dispatch mode when a kept region opens and pops it when the
# last one closes (eager/engine.py), outside any ``with`` block: entering and exiting the
# mode object by hand. TorchDispatchMode.__exit__ pops the *top* of the mode stack, whatever
# it is, so we pop only when the top is ours.
_current_dispatch_mode = private("torch.utils._python_dispatch", "_get_current_dispatch_mode")


def push_dispatch_mode(mode: Any) -> None:
    """Push ``mode`` on the dispatch-mode stack (``mode.__enter__()``)."""
    mode.__enter__()


def pop_dispatch_mode(mode: Any) -> bool:
    """Pop ``mode`` if it is on top of the dispatch-mode stack; whether it was."""
    if _current_dispatch_mode() is not mode:
        return False
    mode.__exit__(None, None, None)
    return True


@functools.cache
def _holders_base() -> int:
    # A storage whose Python object was ever made (untyped_storage(), which is how we name
    # storages) counts one more use than the tensors on it: probe how many.
    t = torch.empty(1)
    ref = cast(Any, StorageWeakRef)(t.untyped_storage())
    return torch._C._storage_Use_Count(ref.cdata) - 1


def storage_holders(ref: Any) -> int:
    """How many tensors (views and detached aliases included) hold the storage behind the
    weak reference ``ref`` (a ``StorageWeakRef``); 0 once it is freed
    (``torch._C._storage_Use_Count``, the count of the storage's strong references)."""
    if ref.expired():
        return 0
    return torch._C._storage_Use_Count(ref.cdata) - _holders_base()


# Note [our dispatch modes run outside Dynamo]
# TorchDispatchMode.__init_subclass__ wraps every subclass's __torch_dispatch__ in
# torch._disable_dynamo(recursive=True) (unless the class's _should_skip_dynamo() says
# False): were a compiled function called under the mode, Dynamo would otherwise trace
# the mode's frames. That wrapper costs a few microseconds on every op the mode sees, a
# third of the eager engine's own cost per op. dynamo_free does the same job for less:
# the wrapper's code is marked for Dynamo to skip (its frame is never traced) and it
# clears the eval-frame callback around the body (so no frame below it is traced), with
# torch._C._dynamo.eval_frame.set_eval_frame, the C call the disable wrapper makes.
_set_eval_frame = torch._C._dynamo.eval_frame.set_eval_frame


def dynamo_free(cls: type[Any]) -> type[Any]:
    """Class decorator for a ``TorchDispatchMode`` subclass: run its ``__torch_dispatch__``
    with Dynamo off (Note [our dispatch modes run outside Dynamo]); the class must define
    ``_should_skip_dynamo`` returning False, so that torch does not wrap it again."""
    body = cls.__dict__["__torch_dispatch__"]

    def __torch_dispatch__(
        self: Any, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        prior = _set_eval_frame(None)
        try:
            return body(self, func, types, args, kwargs)
        finally:
            if prior is not None:
                _set_eval_frame(prior)

    __torch_dispatch__.__qualname__ = body.__qualname__
    cls.__torch_dispatch__ = __torch_dispatch__
    cls._dynamo_free_codes = (__torch_dispatch__.__code__,)
    cls._dispatch_body = body
    return cls


_skipped: set[type[Any]] = set()


def mark_dynamo_free(mode: Any) -> None:
    """On a mode's first construction: have Dynamo skip its dispatch frame (imports Dynamo,
    which ``import sac_compile`` must not)."""
    cls = type(mode)
    if cls not in _skipped:
        _skipped.add(cls)
        skip = private("torch._dynamo.eval_frame", "skip_code")
        for code in cls._dynamo_free_codes:
            skip(code)


# Note [tensor subclasses in the eager engine]
# A traceable wrapper subclass (DTensor, as tensor parallelism makes it) has no storage of its
# own: the engine's dispatch modes see the subclass's ops (a mode runs before the subclass's
# own dispatch) and autograd saves the subclass tensors, but the bytes live in the inner
# tensors it wraps. The engine names a subclass tensor's storage by its first inner tensor's
# (``__tensor_flatten__``, the subclass protocol AOTAutograd uses), and makes a stand-in of a
# dropped subclass output by ``__tensor_unflatten__`` around stand-ins of the inner tensors
# (``torch.utils._python_dispatch.is_traceable_wrapper_subclass``, a private module).
_is_wrapper_subclass = private("torch.utils._python_dispatch", "is_traceable_wrapper_subclass")
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def storage_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t``, or for a traceable wrapper subclass the (first) inner tensor holding its bytes."""
    while type(t) not in _PLAIN and _is_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
        if not names:
            break
        t = getattr(t, names[0])
    return t


def map_inner(t: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``fn(t)``; for a traceable wrapper subclass (a ``DTensor``) the same subclass and metadata
    around ``fn`` of each of its inner tensors (its local shard), in ``__tensor_flatten__``'s
    order. No op runs on the subclass itself: a ``DTensor``'s own ``clone()`` or ``to()`` would
    redistribute it (a ``Partial`` one is all-reduced into a ``Replicate`` one)."""
    if type(t) in _PLAIN or not _is_wrapper_subclass(t):
        return fn(t)
    names, ctx = t.__tensor_flatten__()  # type: ignore[attr-defined]
    values = {n: getattr(t, n) for n in names}
    inner = {n: map_inner(v, fn) if isinstance(v, torch.Tensor) else v for n, v in values.items()}
    made: torch.Tensor = type(t).__tensor_unflatten__(inner, ctx, t.shape, t.stride())  # type: ignore[attr-defined]
    return made


def stand_in_maker(t: torch.Tensor) -> Callable[[], torch.Tensor]:
    """A function making an uninitialised stand-in of ``t``: a tensor of its geometry, dtype
    and device; for a traceable wrapper subclass the same subclass and metadata around
    stand-ins of its inner tensors. It holds no reference to ``t``'s bytes."""
    if type(t) in _PLAIN or not _is_wrapper_subclass(t):
        shape, stride, dtype, device = t.shape, t.stride(), t.dtype, t.device
        return lambda: torch.empty_strided(shape, stride, dtype=dtype, device=device)
    names, ctx = t.__tensor_flatten__()  # type: ignore[attr-defined]
    # (an inner attribute may be an opaque object, not a tensor: DTensor's device_mesh in 2.13)
    values = {n: getattr(t, n) for n in names}
    makers = {n: stand_in_maker(v) for n, v in values.items() if isinstance(v, torch.Tensor)}
    opaque = {n: v for n, v in values.items() if n not in makers}
    cls, size, stride = type(t), t.shape, t.stride()

    def make() -> torch.Tensor:
        made: torch.Tensor = cls.__tensor_unflatten__(  # type: ignore[attr-defined]
            {**opaque, **{n: f() for n, f in makers.items()}}, ctx, size, stride
        )
        return made

    return make


def reentrant_checkpoint_wrapper(module: torch.nn.Module) -> torch.nn.Module:
    """``checkpoint_wrapper(module, checkpoint_impl=CheckpointImpl.REENTRANT)`` from
    ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper``, as trainers import it
    (xtuner v1's recompute wrapper; the fixtures reproduce it)."""
    wrapper = private("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "checkpoint_wrapper")
    impl = private("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "CheckpointImpl")
    wrapped: torch.nn.Module = wrapper(module, checkpoint_impl=impl.REENTRANT)
    return wrapped
