"""What sac-compile relies on of Hugging Face ``transformers``' checkpointing conventions,
in one place (transformers is never imported here: these are duck-typed reads of its
modules, so code without transformers pays nothing).

transformers 5.x checkpoints each decoder layer in ``GradientCheckpointingLayer.forward``
(``transformers/modeling_layers.py``): when the layer's ``gradient_checkpointing`` flag is
set, in training and with grad enabled, it calls ``_gradient_checkpointing_func`` on the
layer's forward, and first turns cache writes off (``use_cache=False``; ``cache`` and
``layer_past`` set to None unless the class sets ``_can_checkpoint_with_cache``: a layer
that only reads the cache), with a one-time message. A layer that wrote its KV cache in
the forward would write it again in the recompute (the recompute then runs other ops).

The seam wraps a layer's ``__call__``, outside that forward, so it applies the same
treatment itself (:func:`training_call`), in eager and traced calls alike, whenever it
checkpoints: with grad enabled, in train *and* eval mode (transformers checkpoints only
while ``training``; a model in ``eval()`` trained through, dropout off, makes its default
KV cache, which a recompute would write again); the message
is logged once per layer class, from eager code only (a logging call in traced code is a
graph break). transformers' own switch (``activation_checkpointing_enable``, the
``Trainer``) applies its own, and :func:`checkpoints_inside` tells the compile backend
that a model it compiles checkpoints its layers that way.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import re
from collections.abc import Iterator
from typing import Any

import torch.nn as nn

__all__ = [
    "SUPPORTED",
    "cache_arguments",
    "check_version",
    "cache_positions",
    "checkpoints_inside",
    "grouped_query_sdpa",
    "is_checkpointing_layer",
    "kernelized_classes",
    "note_caches_off",
    "own_checkpointing_on",
    "training_call",
    "value_checks_off",
]

log = logging.getLogger("sac_compile")

#: The transformers releases ``sac_compile.hf`` supports, ``(lowest, first unsupported)``, each
#: end tested (5.24.0 with torch 2.13.0, 5.25.0 with torch 2.15.0: the Makefile). 5.23.0 fails
#: (its ``create_causal_mask`` has no ``cache`` argument). 5.25.0 makes ``kernels`` a dependency
#: whose function wrappers set a context variable in the forward of the modules that call them
#: (every attention): :func:`kernelized_classes`.
SUPPORTED = ((5, 24, 0), (5, 26, 0))
#: Set to 1 to use another release anyway (a warning instead of the error).
ANY_RELEASE_ENV = "SAC_COMPILE_ANY_TRANSFORMERS"


def _release(version: str) -> tuple[int, ...]:
    """``"5.25.0"`` -> ``(5, 25, 0)``; a pre-release or local suffix counts as its release."""
    found = re.match(r"(\d+)(?:\.(\d+))?(?:\.(\d+))?", version)
    return tuple(int(p or 0) for p in found.groups()) if found else (0, 0, 0)


def check_version(version: str | None = None) -> None:
    """Refuse a transformers release outside :data:`SUPPORTED` (``version``: the installed one,
    read from its package metadata without importing it; nothing to check when it is not
    installed). Called when ``sac_compile.hf`` is imported: one clear error instead of a
    ``TypeError`` deep inside transformers at the first layer call."""
    if version is None:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as installed

        try:
            version = installed("transformers")
        except PackageNotFoundError:
            return
    low, high = SUPPORTED
    if low <= _release(version) < high:
        return
    text = f">={'.'.join(map(str, low))},<{'.'.join(map(str, high[:2]))}"
    message = (
        f"sac_compile.hf supports transformers {text}; transformers {version} is "
        f"installed. Install a supported release (pip install 'transformers{text}'), or set "
        f"{ANY_RELEASE_ENV}=1 to try this one (a warning instead of this error)"
    )
    if os.environ.get(ANY_RELEASE_ENV) == "1":
        import warnings

        warnings.warn(message, stacklevel=3)
        return
    raise ImportError(message)


# The keyword arguments GradientCheckpointingLayer.forward turns off (name -> value off).
_CACHE_KWARGS = {"use_cache": False, "cache": None, "layer_past": None, "past_key_values": None}
_READ_ONLY_OK = ("use_cache",)  # all a cache-reading layer (_can_checkpoint_with_cache) loses
_noted: set[str] = set()


def is_checkpointing_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers ``GradientCheckpointingLayer`` (its class carries
    the ``_can_checkpoint_with_cache`` flag that class defines)."""
    return hasattr(type(module), "_can_checkpoint_with_cache") and hasattr(module, "gradient_checkpointing")


def own_checkpointing_on(module: nn.Module) -> bool:
    """Whether transformers' own checkpointing is switched on for this layer."""
    return getattr(module, "gradient_checkpointing", False) is True


def kernelized_classes(root: nn.Module) -> list[str]:
    """The classes under ``root`` whose forward ``kernels.use_kernelized_func`` wrapped (transformers
    5.25+: each instance carries ``_kernel_funcs``). The wrapper sets and resets a module-level
    ``CompileableContextVar`` around the forward; while Dynamo traces, that is an attribute
    mutation of a global object, which Dynamo refuses inside ``torch.utils.checkpoint`` (a graph
    break at every checkpointed layer: "HOP: Unsafe side effect") unless told that forward side
    effects need not be replayed in the backward. The set and the reset leave nothing to replay."""
    return sorted({type(m).__name__ for m in root.modules() if "_kernel_funcs" in vars(m)})


def checkpoints_inside(root: nn.Module) -> bool:
    """Whether transformers' own checkpointing is on for some layer under ``root``."""
    return any(is_checkpointing_layer(m) and own_checkpointing_on(m) for m in root.modules())


def cache_positions(cls: type[nn.Module]) -> tuple[tuple[str, int], ...]:
    """``(name, index in the call's positional arguments)`` of the cache parameters of
    ``cls.forward`` (GPT-2 and RecurrentGemma pass the cache positionally). The signature
    is the layer's own: transformers' wrappers keep it (``functools.wraps``). Read once per
    class, when the seam generates its subclass, so that Dynamo never traces it."""
    try:
        params = list(inspect.signature(cls.forward).parameters)[1:]  # less self
    except (TypeError, ValueError):
        return ()
    return tuple((name, i) for i, name in enumerate(params) if name in _CACHE_KWARGS)


def training_call(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], cache_args: tuple[tuple[str, int], ...]
) -> tuple[tuple[Any, ...], dict[str, Any], list[str]]:
    """``(args, kwargs, what was turned off)`` for a checkpointed call of a transformers layer
    (grad enabled, train or eval mode): cache writes off, as transformers' own checkpointing turns
    them off (see the module docstring), whether passed by keyword or by position
    (``cache_args``: :func:`cache_positions` of the layer's class); the arguments given are
    not changed."""
    turned: list[str] = []
    layer_cls: type[Any] = type(module)  # a GradientCheckpointingLayer (duck-typed)
    names = _READ_ONLY_OK if layer_cls._can_checkpoint_with_cache else _CACHE_KWARGS
    positions = dict(cache_args)
    new_kwargs = None
    for name in names:
        off = _CACHE_KWARGS[name]
        i = positions.get(name)
        if i is not None and i < len(args):
            if args[i] is not None and args[i] is not False:
                args = args[:i] + (off,) + args[i + 1 :]
                turned.append(f"{name}={off}")
        elif name in kwargs and kwargs[name] is not None and kwargs[name] is not False:
            new_kwargs = dict(kwargs) if new_kwargs is None else new_kwargs
            new_kwargs[name] = off
            turned.append(f"{name}={off}")
    return args, kwargs if new_kwargs is None else new_kwargs, turned


def note_caches_off(layer: str, turned: list[str]) -> None:
    """Log, once per layer class, that a checkpointed layer was called with caching off."""
    if layer not in _noted:
        _noted.add(layer)
        log.warning(
            "sac_compile: caching is incompatible with activation checkpointing in %s: calling it with %s "
            "while it is checkpointed (grad enabled), as transformers' own checkpointing does while "
            "training (a cache written in the forward would be written again in the recompute)",
            layer,
            ", ".join(turned),
        )


def cache_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str]:
    """``name (class)`` of each argument that is a transformers cache object (a ``Cache``:
    its class name ends in "Cache" and it has ``get_seq_length``), for error messages."""
    found = []
    items = [(f"argument {i}", a) for i, a in enumerate(args)] + list(kwargs.items())
    for name, value in items:
        if type(value).__name__.endswith("Cache") and hasattr(value, "get_seq_length"):
            found.append(f"{name} ({type(value).__name__})")
    return found


def from_config(model_cls: type[Any], config: Any, **kwargs: Any) -> nn.Module:
    """A transformers model of ``model_cls`` built from ``config`` with random weights
    (``PreTrainedModel._from_config``: no checkpoint is read), ``kwargs`` such as
    ``attn_implementation`` passed on."""
    model: nn.Module = model_cls._from_config(config, **kwargs)
    return model


@contextlib.contextmanager
def value_checks_off() -> Iterator[None]:
    """While open, transformers skips its checks on tensor values
    (``torch_compilable_check``: "image features and image tokens do not match", ...): its own
    switch, ``TRANSFORMERS_DISABLE_TORCH_CHECK=1``, read at every check. For a forward on
    fake tensors of a meta model, whose values do not exist."""
    with _env("TRANSFORMERS_DISABLE_TORCH_CHECK"):
        yield


@contextlib.contextmanager
def grouped_query_sdpa(on: bool = True) -> Iterator[None]:
    """While open (and ``on``), transformers' SDPA attention hands grouped-query keys and
    values to ``scaled_dot_product_attention`` as they are (``enable_gqa=True``) instead of
    repeating them to the query's heads first: what it does on a CUDA device when the causal
    mask is skipped (training without padding), read from its own switch,
    ``TRANSFORMERS_SDPA_FORCE_GQA=1``. For tracing a GPU's step on another device, where a
    mask is built and the keys and values would be repeated (4x a Llama-3 layer's)."""
    if not on:
        yield
        return
    with _env("TRANSFORMERS_SDPA_FORCE_GQA"):
        yield


@contextlib.contextmanager
def _env(key: str) -> Iterator[None]:
    before = os.environ.get(key)
    os.environ[key] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before
