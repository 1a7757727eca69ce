"""What an op does, read off its schema, its arguments and its outputs: storages it
reads and makes, writes (in place and ``out=``), randomness and RNG state, collectives'
waits, autocast's weight casts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .._compat.checkpoint import tree_leaves


def _storage(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage()._cdata
    except (NotImplementedError, RuntimeError):
        return None


class _StorageSet:
    """Storages by address, ignoring addresses whose storage has since been freed.

    A freed storage's address is soon reused by a new tensor; weak references
    tell the two apart.
    """

    def __init__(self) -> None:
        self._refs: dict[int, StorageWeakRef] = {}

    def add_tensor(self, t: torch.Tensor) -> None:
        try:
            ref = StorageWeakRef(t.untyped_storage())
        except (NotImplementedError, RuntimeError):
            return
        self._refs[ref.cdata] = ref

    def __contains__(self, cdata: object) -> bool:
        ref = self._refs.get(cdata)  # type: ignore[arg-type]
        return ref is not None and not ref.expired()

    def ever(self) -> tuple[int, ...]:
        """Every storage ever added, freed or not."""
        return tuple(self._refs)

    def live(self) -> tuple[int, ...]:
        return tuple(c for c, r in self._refs.items() if not r.expired())


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _tensor_storages(tree: Any) -> tuple[int, ...]:
    out = []
    for t in tree_leaves(tree):
        if isinstance(t, torch.Tensor):
            s = _storage(t)
            if s is not None:
                out.append(s)
    return tuple(out)


@dataclass
class _Writes:
    """What an op writes, read off its schema (not its name)."""

    in_place: list[torch.Tensor]  # ``alias_info.is_write`` on a non-``out`` argument
    out: list[torch.Tensor]  # ``out=`` arguments
    # An ``out=`` variant writes its result into a caller's buffer: never served
    # from the cache, since in the recompute the buffer may be a new one
    # (Inductor's extern kernels allocate theirs), which only re-running fills.
    has_out: bool


def _writes(func: Any, args: tuple, kwargs: dict) -> _Writes:
    writes = _Writes([], [], False)
    schema = getattr(func, "_schema", None)
    if schema is None:
        return writes
    for i, arg in enumerate(schema.arguments):
        info = arg.alias_info
        if not arg.is_out and (info is None or not info.is_write):
            continue
        passed = arg.name in kwargs or i < len(args)
        value = kwargs.get(arg.name, args[i] if i < len(args) else None)
        tensors = [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
        if arg.is_out:
            writes.out.extend(tensors)
            writes.has_out = writes.has_out or passed
        else:
            writes.in_place.extend(tensors)
    return writes


def _served_write(func: Any):
    """For a kept in-place write into an outside tensor: return that argument in the recompute.

    Only for ops that return nothing, or whose single return aliases the
    (first) written argument (``add_``, ``mul_``, ``copy_`` ...); None otherwise
    (the op is then cached as usual).
    """
    schema = func._schema
    rets = schema.returns
    index, arg = next(
        (
            (i, a)
            for i, a in enumerate(schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write
        ),
        (None, None),
    )
    if arg is None:
        return None
    if len(rets) == 0:
        return lambda args, kwargs: None
    if len(rets) == 1 and rets[0].alias_info is not None:
        if set(rets[0].alias_info.before_set) == set(arg.alias_info.before_set):
            return lambda args, kwargs: kwargs[arg.name] if arg.name in kwargs else args[index]
    return None


def _autocast_weight_cast(func: Any, args: tuple) -> bool:
    """autocast's cast of a leaf that requires grad (a parameter): autocast caches these casts
    for the length of its ``with`` block, so whether the op is dispatched at all depends on
    what ran before (the forward may find a cached cast, the recompute in a fresh autocast
    block will not). Such casts run, and are neither cached nor counted, in both modes: the
    recompute casts again (cheap), exactly as without checkpointing."""
    if func is not torch.ops.aten._to_copy.default or not args:
        return False
    t = args[0]
    # (torch.is_autocast_enabled() reads False here: autocast excludes its own dispatch key
    # while it redispatches the cast. Any cast of a grad-requiring leaf is treated alike.)
    return isinstance(t, torch.Tensor) and t.is_leaf and t.requires_grad


def _wait_functional(func: Any, out: Any) -> None:
    if func.namespace == "_c10d_functional":
        for t in _tensors(out):
            torch.ops._c10d_functional.wait_tensor.default(t)


def _is_random(func: Any, args: tuple = (), kwargs: dict | None = None) -> bool:
    """Draws from the RNG: tagged ``nondeterministic_seeded``, except an attention kernel
    called with ``dropout_p=0`` (the CPU flash kernel carries the tag whatever its dropout;
    torch 2.15's partitioner, ``is_rng_op``, makes the same exception)."""
    if torch.Tag.nondeterministic_seeded not in getattr(func, "tags", ()):
        return False
    schema = getattr(func, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    if "dropout_p" not in names:
        return True
    i = names.index("dropout_p")
    p = args[i] if i < len(args) else (kwargs or {}).get("dropout_p", schema.arguments[i].default_value)
    return not (isinstance(p, (int, float)) and p == 0)


def _rng_state(tree: Any) -> tuple:
    """The RNG state a random op will draw from: an explicit generator's, else the defaults'."""
    generators = [g for g in tree_leaves(tree) if isinstance(g, torch.Generator)]
    if generators:
        return tuple((g, g.get_state()) for g in generators)
    devices = {t.device for t in tree_leaves(tree) if isinstance(t, torch.Tensor)}
    state = [("cpu", torch.get_rng_state())]
    for dev in devices:
        if dev.type == "cuda":
            state.append((dev, torch.cuda.get_rng_state(dev)))
    return tuple(state)


def _set_rng_state(state: tuple) -> None:
    for dev, s in state:
        if isinstance(dev, torch.Generator):
            dev.set_state(s)
        elif dev == "cpu":
            torch.set_rng_state(s)
        else:
            torch.cuda.set_rng_state(s, dev)


def _all_float_tensors(out: Any) -> bool:
    leaves = tree_leaves(out)
    return bool(leaves) and all(
        isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) for t in leaves
    )


class _Geometry:
    """Shape, strides, dtype and device of a dropped cached output."""

    __slots__ = ("device", "dtype", "shape", "stride")

    def __init__(self, t: torch.Tensor) -> None:
        self.shape, self.stride, self.dtype, self.device = t.shape, t.stride(), t.dtype, t.device
