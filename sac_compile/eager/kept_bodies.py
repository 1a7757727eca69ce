"""Kept declared modules whose body skips the recompute (policy ``SAVE_ALL``).

Under ``SAVE_ALL`` nothing in a kept region is recomputed. When the region is a whole
module (declared with :func:`sac_compile.declare_regions`) and no kept region is open
around it, the engine does not need to see its ops at all:

* forward: the body runs with no dispatch mode and with the checkpoint's saved-tensor
  hooks taken off the stack, so autograd saves inside it what it needs, as without
  checkpointing (through a hook that notes the bytes, for the engine's held-bytes table,
  and hands them to any hooks of yours below the checkpoint), except what is one of the
  body's tensor arguments or a view of one (a projection's input): that goes to a
  checkpoint holder, as anything saved outside the body, since the recompute remakes the
  argument. Its outputs are kept;
* recompute: the module's ``forward`` is replaced for the length of the recompute; the
  body does not run: the arguments it saved fill their holders (the same views of the
  arguments the recompute made) and the kept outputs are handed back (requiring grad as
  in the forward, so that the ops after it save what they saved). Where the body drew
  random numbers the generator is set to where the forward left it.

The body runs again in the recompute instead (with the checkpoint's hooks off the stack,
as in the forward) when its outputs cannot stand for it: the body wrote into one of its
tensor arguments (the recompute may make that argument anew), or something wrote into
an output after the forward returned it (version counters). A body the recompute never
reaches (the checkpoint's early stop: nothing was saved after it) keeps nothing.

Bytes: what autograd saves inside the body, less the arguments, plus the kept outputs the
recompute reads: what ``torch_remat`` holds for a save region (``benchmarks/peers.py``),
with none of the dispatch mode's per-op cost.
"""

from __future__ import annotations

from typing import Any, Literal, cast

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .._compat.checkpoint import (
    pop_hooks,
    pop_saved_tensors_hooks,
    push_hooks,
    push_saved_tensors_hooks,
    top_saved_tensors_hooks,
    tree_map,
)
from .._compat.tensors import version
from .op_facts import restore_rng_state, rng_state, storage_of, tensors_in, untyped_storage_of

__all__ = ["Bodies"]

_MISSING = object()


class _Kept:
    """A kept output tensor: a detached alias, its version and whether it required grad."""

    __slots__ = ("requires_grad", "value", "version")

    def __init__(self, t: torch.Tensor) -> None:
        self.value = t.detach()
        self.version = version(t)
        self.requires_grad = t.requires_grad


def _keep(x: Any) -> Any:
    return _Kept(x) if isinstance(x, torch.Tensor) else x


def _serve(x: Any) -> Any:
    if isinstance(x, _Kept):
        return x.value.detach().requires_grad_(x.requires_grad)
    return x


def _is_kept(x: Any) -> bool:
    return isinstance(x, _Kept)


# what a kept output may hold besides tensors: served as is
_PLAIN = (type(None), bool, int, float, complex, str, torch.dtype, torch.device, torch.Size)


def _rng_devices(tensors: list[torch.Tensor]) -> tuple:
    """What to take the RNG state of around a body: its tensor arguments, and every CUDA
    device in use (the body may draw on one none of its arguments is on)."""
    if not torch.cuda.is_initialized():
        return tuple(tensors)
    return (*tensors, *(torch.device("cuda", i) for i in range(torch.cuda.device_count())))


def _same_rng(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(
        da == db and torch.equal(sa, sb) for (da, sa), (db, sb) in zip(a, b, strict=True)
    )


class _Body:
    """One call of a kept module (or decorated function) whose body skips the recompute."""

    def __init__(self, module: Any, region: str, args: tuple, kwargs: dict) -> None:
        self.module, self.region = module, region  # (module: the decorated function, for one)
        tensors = tensors_in((args, kwargs))
        self.inputs = [(t, version(t)) for t in tensors]  # dropped at the exit
        # what autograd saved inside the body that is one of its tensor arguments (or a view
        # of one), in save order: (argument index, view geometry or None); each went to a
        # checkpoint holder, filled again by the recompute (see Bodies.enter)
        self.input_saves: list[tuple[int, tuple | None]] = []
        self.input_storages: tuple[int, ...] = ()
        self.rng_before: tuple | None = rng_state(_rng_devices(tensors))  # None once it exited
        self.rng_after: Any = None
        self.outputs: Any = None  # tree of _Kept; None: the body runs in the recompute
        self.rerun = False
        # what autograd saved inside the body: storage -> (weak reference, bytes)
        self.saved: dict[int, tuple[StorageWeakRef, int]] = {}
        self.packs_at_exit = 0
        self.popped: list = []
        # the body ran under the dispatch mode after all: saved-tensor hooks of yours
        # pushed inside the checkpointed function were on top of ours
        self.declined = False


class Bodies:
    """The kept module bodies of one checkpointed call (see the module docstring)."""

    def __init__(self, state: Any) -> None:
        self.state = state  # the call's EngineState
        self.order: list[_Body] = []
        self.by_module: dict[int, list[_Body]] = {}
        # decorated functions' calls, in the forward's order (their wrapper is ours: the
        # recompute asks for the next one, no forward to replace)
        self.calls: list[_Body] = []
        self.call_next = 0
        self.next: dict[int, int] = {}  # (recompute) the next body of each module
        # (recompute) modules whose pre-hook just chose to skip this call: the replaced
        # forward runs every call of the module, kept span or not, and serves these only
        self.armed: set[int] = set()
        self.patched: list[tuple[torch.nn.Module, Any]] = []
        self.open: _Body | None = None  # (forward) the body running now, off the hooks

    # -- forward ---------------------------------------------------------------
    def enter(self, region: str, module: torch.nn.Module, args: tuple, kwargs: dict) -> _Body | None:
        """(forward, the module's pre-hook) Start skipping ``module``'s body, or None when
        saved-tensor hooks were pushed inside the checkpointed function (on top of ours):
        the body then saves through them, under the dispatch mode, as any kept region.
        (A module compiled on its own, ``module.compile()``, never gets here: Dynamo
        traces its hooks, which then emit marker ops.)"""
        top = top_saved_tensors_hooks()
        if top is None or top[0] is not self.state.pack_hook:
            self.decline(module, region)
            return None
        body = _Body(module, region, args, kwargs)
        checkpoint_pack, checkpoint_unpack = top
        # the engine's pack hook, then the checkpoint's: autograd saves natively below
        body.popped = pop_saved_tensors_hooks(2)
        below = top_saved_tensors_hooks()
        arguments = _argument_storages(body.inputs)

        def pack(t: torch.Tensor) -> Any:
            s = storage_of(t)
            i = arguments.get(s) if s is not None else None
            if i is not None and (geometry := _argument_view(t, *body.inputs[i])) is not False:
                body.input_saves.append((i, geometry))
                return _FromCheckpoint(checkpoint_pack(t))
            if s is not None and s not in body.saved:
                storage = untyped_storage_of(t)
                body.saved[s] = (StorageWeakRef(storage), storage.nbytes())
            return below[0](t) if below is not None else t.detach()

        def unpack(x: Any) -> Any:
            if type(x) is _FromCheckpoint:
                return checkpoint_unpack(x.holder)
            return below[1](x) if below is not None else x

        push_hooks(pack, unpack)
        self.open = body
        return body

    def decline(self, fn: Any, region: str) -> None:
        """(forward) A call of ``fn`` (a module, a function) that runs under the engine as any
        code, recorded so that the recompute finds it in its place and runs it too."""
        declined = _Body(fn, region, (), {})
        declined.declined = True
        self._record(declined)

    def _restore_hooks(self, body: _Body) -> None:
        if body.popped:
            pop_hooks()
            push_saved_tensors_hooks(body.popped)
            body.popped = []
        self.open = None

    def abort(self) -> None:
        """The forward raised past a running body (KeyboardInterrupt: no module hook runs):
        put the hooks back before the enclosing contexts pop theirs."""
        if self.open is not None:
            self._restore_hooks(self.open)

    def exit(self, body: _Body, output: Any) -> None:
        self._restore_hooks(body)
        if self.state.preserve_rng_state:
            rng = rng_state(_rng_devices([t for t, _ in body.inputs]))
            if not _same_rng(rng, cast(tuple, body.rng_before)):
                body.rng_after = rng
        body.rng_before = None
        body.rerun = any(version(t) != v for t, v in body.inputs)
        body.input_storages = tuple(s for t, _ in body.inputs if (s := storage_of(t)) is not None)
        body.inputs = []
        if not body.rerun and output is not None:  # (None: it raised, or returned nothing)
            kept = tree_map(_keep, output)
            # (an object pytree does not open is not kept: it could not be checked)
            if all(isinstance(x, (_Kept, *_PLAIN)) for x in _leaves_of_tree(kept)):
                body.outputs = kept
        body.rerun = body.outputs is None
        body.packs_at_exit = self.state.packs
        self.order.append(body)
        self._record(body)

    def _record(self, body: _Body) -> None:
        if isinstance(body.module, torch.nn.Module):
            self.by_module.setdefault(id(body.module), []).append(body)
        else:
            self.calls.append(body)

    def finalize(self, early_stop: bool) -> None:
        """End of the forward: a body whose outputs were written since runs again in the
        recompute; one the recompute never reaches keeps no outputs. What autograd saved
        inside a body is held either way (as without checkpointing), and counted."""
        st = self.state
        for body in self.order:
            if body.outputs is not None:
                if _written(body.outputs):
                    body.outputs, body.rerun = None, True
                elif early_stop and st.packs == body.packs_at_exit:
                    body.outputs = None  # (nothing saved after it: the recompute stops before)
            if body.rerun:
                st.mark_needed(body.input_storages)
            held = {c: n for c, (ref, n) in body.saved.items() if not ref.expired()}
            for k in _leaves_of(body.outputs):
                s = storage_of(k.value)
                if s is not None and s not in held:
                    held[s] = untyped_storage_of(k.value).nbytes()
            nbytes = sum(held.values())
            st.stats.held_bytes += nbytes
            st.stats.held_by_region[body.region] += nbytes
            st.stats.bodies[
                "rerun" if body.rerun else "skipped" if body.outputs is not None else "unreached"
            ] += 1
            body.saved = {}  # (Note [weak references to storages])

    # -- recompute -------------------------------------------------------------
    def arm(self, module: torch.nn.Module) -> bool:
        """(recompute, the module's pre-hook) Whether the forward skipped this call's body
        (the same conditions held; calls come in the forward's order): arm its forward."""
        bodies = self.by_module.get(id(module))
        i = self.next.get(id(module), 0)
        if bodies is None or i >= len(bodies):
            return False
        if bodies[i].declined:
            self.next[id(module)] = i + 1  # (it runs under the dispatch mode, as in the forward)
            return False
        self.armed.add(id(module))
        return True

    def next_call(self, fn: Any) -> _Body | None:
        """(recompute, a decorated function's wrapper) The forward's record of this call, if
        the forward skipped its body (None: it ran under the dispatch mode)."""
        if self.call_next >= len(self.calls):
            return None
        body = self.calls[self.call_next]
        self.call_next += 1
        if getattr(body.module, "__code__", body.module) is not getattr(fn, "__code__", fn):
            raise AssertionError(
                f"sac_compile internal error: the recompute called {fn} where the forward called "
                f"{body.module}; please report this with the model"
            )
        return None if body.declined else body

    def replay(self, body: _Body, run: Any, args: tuple, kwargs: dict) -> Any:
        """(recompute) Hand back ``body``'s outputs, or run it again off the checkpoint's hooks;
        first, the arguments the forward's body saved go to their checkpoint holders."""
        if body.input_saves:
            tensors = tensors_in((args, kwargs))
            # (the engine's recompute hook, then the checkpoint's: there is one while recomputing)
            pack = cast("tuple[Any, Any]", top_saved_tensors_hooks())[0]
            for i, geometry in body.input_saves:
                t = tensors[i]
                pack(t if geometry is None else t.as_strided(*geometry))
        if body.outputs is not None:
            if _written(body.outputs):
                raise RuntimeError(
                    f"sac_compile: an output of kept region {body.region!r} ({_describe(body.module)}) "
                    "was written in place after the checkpointed function returned; the recompute "
                    "would hand back the written value (the forward's is gone). Write into a copy "
                    "(out = out.clone()), or keep the region with the default policy"
                )
            out = tree_map(_serve, body.outputs, is_leaf=_is_kept)
            if body.rng_after is not None:
                restore_rng_state(body.rng_after)
            return out
        # (the checkpoint's, and the engine's in front of it: eager/engine.py)
        popped = pop_saved_tensors_hooks(self.state.recompute_hooks)
        try:
            return run(*args, **kwargs)
        finally:
            push_saved_tensors_hooks(popped)

    def start_recompute(self) -> None:
        self.next, self.armed, self.call_next = {}, set(), 0
        for bodies in self.by_module.values():
            module = bodies[0].module
            self.patched.append((module, module.__dict__.get("forward", _MISSING)))
            module.__dict__["forward"] = self._skipper(module)

    def end_recompute(self) -> None:
        for module, old in reversed(self.patched):
            if old is _MISSING:
                module.__dict__.pop("forward", None)
            else:
                module.__dict__["forward"] = old
        self.patched = []

    def _skipper(self, module: torch.nn.Module):
        old = module.__dict__.get("forward", _MISSING)
        run = type(module).forward.__get__(module) if old is _MISSING else old
        bodies = self.by_module[id(module)]

        def forward(*args: Any, **kwargs: Any) -> Any:
            if id(module) not in self.armed:
                return run(*args, **kwargs)  # a call the forward did not skip
            self.armed.discard(id(module))
            i = self.next.get(id(module), 0)
            self.next[id(module)] = i + 1
            return self.replay(bodies[i], run, args, kwargs)

        return forward


class _FromCheckpoint:
    """What a body saved that is one of its arguments: the checkpoint's holder for it."""

    __slots__ = ("holder",)

    def __init__(self, holder: Any) -> None:
        self.holder = holder


def _argument_storages(inputs: list[tuple[torch.Tensor, int]]) -> dict[int, int]:
    """Storage -> index of the first plain tensor argument on it."""
    found: dict[int, int] = {}
    for i, (t, _) in enumerate(inputs):
        if type(t) is torch.Tensor and t.layout == torch.strided and (s := storage_of(t)) is not None:
            found.setdefault(s, i)
    return found


def _argument_view(t: torch.Tensor, argument: torch.Tensor, at_version: int) -> tuple | None | Literal[False]:
    """How to make ``t`` from the argument it shares a storage with: None (it is the argument's
    geometry), ``(size, stride, offset)`` for ``as_strided``, or False where it cannot be
    remade so (another dtype or type, or the argument was written since the body began)."""
    if type(t) is not torch.Tensor or t.dtype != argument.dtype or version(argument) != at_version:
        return False
    if t.is_conj() or t.is_neg():
        return False
    geometry = (tuple(t.size()), tuple(t.stride()), t.storage_offset())
    if geometry == (tuple(argument.size()), tuple(argument.stride()), argument.storage_offset()):
        return None
    return geometry


def _describe(owner: Any) -> str:
    return (
        type(owner).__name__
        if isinstance(owner, torch.nn.Module)
        else getattr(owner, "__qualname__", repr(owner))
    )


def _leaves_of_tree(tree: Any) -> list:
    out: list = []
    tree_map(out.append, tree, is_leaf=_is_kept)
    return out


def _leaves_of(tree: Any) -> list[_Kept]:
    return [x for x in _leaves_of_tree(tree) if isinstance(x, _Kept)]


def _written(outputs: Any) -> bool:
    """Whether a kept output was written in place since it was kept."""
    return any(version(k.value) != k.version for k in _leaves_of(outputs))
