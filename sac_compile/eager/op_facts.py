"""What an op does, read off its schema, its arguments and its outputs: storages it
reads and makes, writes (in place and ``out=``), randomness and RNG state, collectives'
waits, autocast's weight casts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .._compat.checkpoint import stand_in_maker, storage_tensor, tree_leaves, tree_map
from .._compat.ops import schema as op_schema
from .._compat.tensors import storage_id


def untyped_storage_of(t: torch.Tensor) -> Any:
    """The storage holding ``t``'s bytes (a tensor subclass's: its inner tensor's, Note
    [tensor subclasses in the eager engine] in sac_compile/_compat/checkpoint.py), or None
    (sparse, ...)."""
    try:
        return storage_tensor(t).untyped_storage()
    except (NotImplementedError, RuntimeError):
        return None


def byte_span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage ``t`` can reach: ``[start, end)`` (empty for no element)."""
    if t.numel() == 0:
        return (0, 0)
    size = t.element_size()
    first = cast(int, t.storage_offset())  # a real tensor (the eager engine): never a SymInt
    last = first + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True) if st > 0)
    first += sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True) if st < 0)
    return (first * size, (last + 1) * size)


def storage_of(t: torch.Tensor) -> int | None:
    s = untyped_storage_of(t)
    return None if s is None else storage_id(s)


class StorageSet:
    """Storages by address, ignoring addresses whose storage has since been freed.

    A freed storage's address is soon reused by a new tensor; weak references
    tell the two apart.
    """

    def __init__(self) -> None:
        self._refs: dict[int, StorageWeakRef] = {}

    def add_tensor(self, t: torch.Tensor) -> None:
        storage = untyped_storage_of(t)
        if storage is not None:
            ref = StorageWeakRef(storage)
            self._refs[ref.cdata] = ref

    def add_storage(self, storage: Any) -> None:
        ref = StorageWeakRef(storage)
        self._refs[ref.cdata] = ref

    def __bool__(self) -> bool:
        return bool(self._refs)

    def ref(self, cdata: object) -> StorageWeakRef | None:
        return self._refs.get(cdata)  # type: ignore[call-overload]

    def __contains__(self, cdata: object) -> bool:
        ref = self._refs.get(cdata)  # type: ignore[call-overload]
        return ref is not None and not ref.expired()

    def ever(self) -> tuple[int, ...]:
        """Every storage ever added, freed or not."""
        return tuple(self._refs)

    def live(self) -> tuple[int, ...]:
        return tuple(c for c, r in self._refs.items() if not r.expired())


# Op arguments and outputs are flat: tensors, scalars, None, and lists or tuples of them
# (a multi-output op returns a plain tuple). These walk those directly; anything else
# (a dict, a nested container of another kind) goes through pytree. They run for every
# op of a kept span, where pytree's generality cost more than the rest of the engine.


_LEAF_TYPES = (
    torch.Tensor,
    int,
    float,
    bool,
    complex,
    str,
    type(None),
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
    torch.Generator,
)


def _flatten(x: Any, out: list) -> None:
    if isinstance(x, (tuple, list)):
        for y in x:
            if isinstance(y, _LEAF_TYPES):
                out.append(y)
            else:
                _flatten(y, out)
    elif isinstance(x, dict):
        for y in x.values():
            _flatten(y, out)
    elif isinstance(x, _LEAF_TYPES):
        out.append(x)
    else:
        out.extend(tree_leaves(x))


def flat_leaves(tree: Any) -> list:
    if isinstance(tree, torch.Tensor):
        return [tree]
    out: list = []
    _flatten(tree, out)
    return out


def tensors_in(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    return [t for t in flat_leaves(tree) if isinstance(t, torch.Tensor)]


def tensor_storages(tree: Any) -> tuple[int, ...]:
    out = []
    for t in tensors_in(tree):
        s = storage_of(t)
        if s is not None:
            out.append(s)
    return tuple(out)


def arg_storages(args: Any) -> tuple[int, ...]:
    """:func:`tensor_storages` of an op's flat arguments (a tuple, or a dict's values),
    without pytree; nested containers take the general path."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            s = storage_of(a)
            if s is not None:
                out.append(s)
        elif isinstance(a, (tuple, list)):
            if a and isinstance(a[0], (int, float)):
                continue  # an int[] / float[] argument (a shape, dims): no tensor in it
            for b in a:
                if isinstance(b, torch.Tensor):
                    s = storage_of(b)
                    if s is not None:
                        out.append(s)
                elif isinstance(b, (tuple, list, dict)):
                    return tensor_storages(tuple(args))
        elif isinstance(a, dict):
            return tensor_storages(tuple(args))
    return tuple(out)


def storage_objects(tensors: list[torch.Tensor]) -> list:
    """The untyped storage of each tensor (None where it has none: sparse, ...)."""
    return [untyped_storage_of(t) for t in tensors]


def map_leaves(fn: Any, tree: Any) -> Any:
    """``tree_map`` for an op's output: a leaf, or a flat tuple / list of leaves."""
    if isinstance(tree, (tuple, list)) and type(tree) in (tuple, list):
        if not any(isinstance(x, (tuple, list, dict)) for x in tree):
            return type(tree)(fn(x) for x in tree)
    elif not isinstance(tree, dict):
        return fn(tree)
    return tree_map(fn, tree)


@dataclass
class Writes:
    """What an op writes, read off its schema (not its name)."""

    in_place: list[torch.Tensor]  # ``alias_info.is_write`` on a non-``out`` argument
    out: list[torch.Tensor]  # ``out=`` arguments
    # An ``out=`` variant writes its result into a caller's buffer: never served
    # from the cache, since in the recompute the buffer may be a new one
    # (Inductor's extern kernels allocate theirs), which only re-running fills.
    has_out: bool


NO_WRITES = Writes([], [], False)


def written_args(func: Any) -> tuple:
    """``((index, name, is_out), ...)`` of the arguments ``func`` writes, from its schema."""
    schema = getattr(func, "_schema", None)
    return tuple(
        (i, arg.name, arg.is_out)
        for i, arg in enumerate(schema.arguments if schema is not None else ())
        if arg.is_out or (arg.alias_info is not None and arg.alias_info.is_write)
    )


def writes_of(func: Any, args: tuple, kwargs: dict, written: tuple | None = None) -> Writes:
    """What ``func`` writes in this call (``written``: its :func:`written_args`, if known)."""
    if written is None:
        written = written_args(func)
    if not written:
        return NO_WRITES  # (shared: never mutated)
    writes = Writes([], [], False)
    for i, name, is_out in written:
        passed = name in kwargs or i < len(args)
        value = kwargs.get(name, args[i] if i < len(args) else None)
        tensors = tensors_in(value)
        if is_out:
            writes.out.extend(tensors)
            writes.has_out = writes.has_out or passed
        else:
            writes.in_place.extend(tensors)
    return writes


def write_server(func: Any):
    """For a kept in-place write into an outside tensor: return that argument in the recompute.

    Only for ops that return nothing, or whose single return aliases the
    (first) written argument (``add_``, ``mul_``, ``copy_`` ...); None otherwise
    (the op is then cached as usual).
    """
    schema = op_schema(func)
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


def autocast_weight_cast(func: Any, args: tuple) -> bool:
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


def wait_functional(func: Any, out: Any) -> None:
    if func.namespace == "_c10d_functional":
        for t in tensors_in(out):
            torch.ops._c10d_functional.wait_tensor.default(t)


def seeded(func: Any) -> int | None:
    """None: ``func`` never draws from the RNG; -1: it always does; else the index of its
    ``dropout_p`` argument (it draws unless that is 0)."""
    if torch.Tag.nondeterministic_seeded not in getattr(func, "tags", ()):
        return None
    schema = getattr(func, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    return names.index("dropout_p") if "dropout_p" in names else -1


_NOT_SEEN = object()


def is_random(func: Any, args: tuple = (), kwargs: dict | None = None, i: Any = _NOT_SEEN) -> bool:
    """Draws from the RNG: tagged ``nondeterministic_seeded``, except an attention kernel
    called with ``dropout_p=0`` (the CPU flash kernel carries the tag whatever its dropout;
    torch 2.15's partitioner, ``is_rng_op``, makes the same exception). ``i``: :func:`seeded`
    of ``func``, if known."""
    if i is _NOT_SEEN:
        i = seeded(func)
    if i is None:
        return False
    if i == -1:
        return True
    p = (
        args[i]
        if i < len(args)
        else (kwargs or {}).get("dropout_p", op_schema(func).arguments[i].default_value)
    )
    return not (isinstance(p, (int, float)) and p == 0)


def rng_state(tree: Any) -> tuple:
    """The RNG state a random op drew from: an explicit generator's, else the defaults' of
    the devices in ``tree`` (the op's arguments *and outputs*: a factory such as
    ``rand(n, device="cuda")`` names its device only in a ``device`` argument and on its
    output)."""
    leaves = flat_leaves(tree)
    generators = [g for g in leaves if isinstance(g, torch.Generator)]
    if generators:
        return tuple((g, g.get_state()) for g in generators)
    devices = [t.device for t in leaves if isinstance(t, torch.Tensor)]
    devices += [d for d in leaves if isinstance(d, torch.device)]
    # (a `device="cuda"` argument has no index: the current device, as the op read it)
    cuda = {
        d.index if d.index is not None else torch.cuda.current_device() for d in devices if d.type == "cuda"
    }
    state: list[tuple[str | torch.device, torch.Tensor]] = [("cpu", torch.get_rng_state())]
    for index in sorted(cuda):
        dev = torch.device("cuda", index)
        state.append((dev, torch.cuda.get_rng_state(dev)))
    return tuple(state)


def restore_rng_state(state: tuple) -> None:
    for dev, s in state:
        if isinstance(dev, torch.Generator):
            dev.set_state(s)
        elif dev == "cpu":
            torch.set_rng_state(s)
        else:
            torch.cuda.set_rng_state(s, dev)


def all_float_tensors(out: Any) -> bool:
    leaves = flat_leaves(out)
    return bool(leaves) and all(
        isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) for t in leaves
    )


class Geometry:
    """What the stand-in of a dropped cached output needs: its shape, strides, dtype and
    device (and, for a tensor subclass, its kind and metadata); ``make()`` builds one."""

    __slots__ = ("make",)

    def __init__(self, t: torch.Tensor) -> None:
        self.make = stand_in_maker(t)
