"""Inductor: its entry points, config, the custom joint-graph pass hook, lowerings and
caches. Inductor is imported on first use: ``import sac_compile`` does not load it.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from . import private

__all__ = [
    "custom_graph_pass_base",
    "cache_dir",
    "compile_caches_enabled",
    "compile_fx",
    "compile_fx_inner",
    "compile_fx_parts",
    "is_compile_fx",
    "pass_skipping_caches_disabled",
    "get_hash_for_files",
    "inductor_config",
    "register_noop_lowerings",
    "seed_ops",
    "custom_graph_passes",
    "seed_creation_ops",
]


def custom_graph_pass_base() -> type:
    """Inductor's custom-pass extension point (``torch/_inductor/custom_graph_pass.py``):
    ``config.joint_custom_pre_pass`` runs on the joint graph before Inductor's own joint
    passes (and so before ``replace_random_passes``); ``uuid()`` enters the FX graph cache
    and AOTAutograd cache keys. Importing it loads Inductor: only the tagging pass's
    module (imported on a backend's first compile) subclasses it."""
    cls: type = private("torch._inductor.custom_graph_pass", "CustomGraphPass")
    return cls


def get_hash_for_files(paths: tuple[str, ...], extra: str = "") -> bytes:
    """A hash of these source files and ``extra`` (``custom_graph_pass.get_hash_for_files``)."""
    found: bytes = private("torch._inductor.custom_graph_pass", "get_hash_for_files")(paths, extra=extra)
    return found


def compile_fx(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable[..., Any]:
    """Inductor's entry point; ``config_patches`` is re-applied for the lazily compiled backward."""
    compiled: Callable[..., Any] = private("torch._inductor.compile_fx", "compile_fx")(
        gm, example_inputs, **kwargs
    )
    return compiled


def _compile_fx_function() -> Any:
    return private("torch._inductor.compile_fx", "compile_fx")


def is_compile_fx(backend: Any) -> bool:
    """``backend`` is Inductor's ``compile_fx`` or a ``functools.partial`` of it (keywords only)."""
    if not callable(backend) or "torch._inductor" not in sys.modules:
        return False  # (a partial of compile_fx would have imported Inductor)
    target = _compile_fx_function()
    return backend is target or (
        isinstance(backend, functools.partial) and backend.func is target and not backend.args
    )


def compile_fx_parts(backend: Any) -> tuple[Callable[..., Any], dict[str, Any]]:
    """``(compile_fx, its keyword arguments)`` of ``backend`` (:func:`is_compile_fx`; ``None``:
    plain Inductor)."""
    if isinstance(backend, functools.partial):
        return backend.func, dict(backend.keywords)
    return compile_fx, {}


def compile_fx_inner(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
    """Inductor's per-graph compiler (``inner_compile``): ``is_backward`` / ``is_inference``
    say which partitioned graph ``gm`` is."""
    return private("torch._inductor.compile_fx", "compile_fx_inner")(gm, example_inputs, **kwargs)


def inductor_config() -> Any:
    """``torch._inductor.config`` (a config module: ``patch()``, settings as attributes)."""
    return private("torch._inductor", "config")


def compile_mode_config(mode: str | None, options: dict[str, Any] | None) -> dict[str, Any]:
    """The Inductor config entries ``torch.compile(mode=..., options=...)`` stand for, checked
    as ``torch.compile`` checks them for its own Inductor backend (``_TorchCompileInductorWrapper``
    in ``torch/__init__.py``: unknown modes, keys and value types raise ``RuntimeError``).
    A custom backend receives ``mode`` and ``options`` as keyword arguments instead."""
    return dict(private("torch", "_TorchCompileInductorWrapper")(mode, options, None).config)


def custom_graph_passes(value: Any) -> tuple[Any, ...]:
    """A ``joint_custom_*_pass`` config value as a tuple of passes: ``None``, one pass, or a
    list / tuple of them (``custom_graph_pass.get_custom_graph_passes``; a tuple is also what
    the config accepts and the cache key hashes, pass by pass)."""
    return tuple(private("torch._inductor.custom_graph_pass", "get_custom_graph_passes")(value))


@functools.cache
def seed_creation_ops() -> frozenset[Any]:
    """The ops that draw seeds from the RNG in Inductor's joint graph: ``inductor_seed`` (one
    per random op, from ``replace_random_passes``) and ``inductor_seeds`` (one per device,
    from ``fuse_seed_creation_pass``, ``torch/_inductor/fx_passes/replace_random.py``)."""
    prims = private("torch._inductor", "inductor_prims")
    return frozenset({prims.seed, prims.seeds})


@functools.cache
def seed_ops() -> frozenset[Any]:
    """Ops that produce random *seeds* (never to be forced to recompute).

    Inductor's replace_random_passes introduces these after our pre-pass; AOT's
    own rng functionalization wraps random ops in run_and_save_rng_state. We list
    them so that a graph that already carries them is handled too.
    """
    found = set(seed_creation_ops()) | {private("torch._inductor", "inductor_prims").lookup_seed}
    hops = torch.ops.higher_order
    for name in ("run_and_save_rng_state", "run_with_rng_state", "graphsafe_run_with_rng_state"):
        op = getattr(hops, name, None)
        if op is not None:
            found.add(op)
    return frozenset(found)


_noop_lowerings_registered = False


def register_noop_lowerings(ops: Iterable[Any]) -> None:
    """Lower ``ops`` (the marker ops) to nothing in Inductor (once, when Inductor is loaded).

    The tagging pass erases markers before Inductor lowers a graph; this covers
    graphs compiled by Inductor *without* the pass (plain ``torch.compile`` on a
    marked model). There, a no-output side-effectful fallback kernel next to
    Inductor's random seeds made the wrapper free a seed buffer before its last
    use (torch 2.13: "cannot access local variable 'bufN'"). Dropping the
    markers at lowering avoids that and leaves no call in the generated code.
    Relies on ``torch._inductor.lowering.register_lowering`` / ``lowerings``.
    Called from the markers' fake implementations once Inductor is loaded: Inductor's
    compile imports its lowerings, then AOTAutograd traces the graph again (the fake
    implementations run) before any lowering; importing ``sac_compile``, and compiling
    with ``aot_eager``, never load Inductor.
    """
    global _noop_lowerings_registered
    if _noop_lowerings_registered or "torch._inductor.lowering" not in sys.modules:
        return  # done, or Inductor is not loaded (a later call registers them)
    _noop_lowerings_registered = True
    lowering = private("torch._inductor", "lowering")

    def _drop_marker(*args: Any, **kwargs: Any) -> None:
        return None

    for op in ops:
        if op not in lowering.lowerings:
            lowering.register_lowering(op, type_promotion_kind=None)(_drop_marker)


def cache_dir() -> str:
    """Inductor's cache directory (``TORCHINDUCTOR_CACHE_DIR`` or the default)."""
    return str(private("torch._inductor.runtime.cache_dir_utils", "cache_dir")())


@contextlib.contextmanager
def pass_skipping_caches_disabled() -> Iterator[None]:
    """Inside the block no compile is served from a cache that would skip the tagging pass:
    Inductor's FX graph cache, the AOTAutograd cache (local and remote) and Dynamo's
    precompile cache are off, and so is Dynamo's profile-guided dynamic-shape cache (it
    would carry shapes between compiles).
    Inductor's kernel caches stay on: a kernel compiled once is not compiled again (unlike
    ``torch.compiler.config.force_disable_caches``, which recompiles every C++ kernel)."""
    functorch_config = private("torch._functorch", "config")
    dynamo_config = private("torch._dynamo", "config")
    with (
        inductor_config().patch(fx_graph_cache=False, fx_graph_remote_cache=False),
        functorch_config.patch(enable_autograd_cache=False, enable_remote_autograd_cache=False),
        dynamo_config.patch(
            automatic_dynamic_local_pgo=False,
            automatic_dynamic_remote_pgo=False,
            caching_precompile=False,  # Dynamo's precompile cache installs whole compiled backends
        ),
    ):
        yield


def compile_caches_enabled() -> bool:
    """Whether FX-graph / AOTAutograd caches may serve a graph without running our pass."""
    if torch.compiler.config.force_disable_caches if hasattr(torch.compiler, "config") else False:
        return False
    functorch_config = private("torch._functorch", "config")
    return bool(inductor_config().fx_graph_cache or functorch_config.enable_autograd_cache)
