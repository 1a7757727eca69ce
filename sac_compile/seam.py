"""The seam, where checkpointing meets a layer's call: ``apply_selective_checkpointing`` (right in every mode).

The module is wrapped *in place*: its class is swapped for a generated subclass
(as ``fully_shard`` does) whose ``_call_impl`` runs the original call, hooks
included, inside the checkpoint. The module object, its ``state_dict`` keys,
parameters, hooks and module paths stay exactly those of the unwrapped module.

Decision table (evaluated at every call):

=====================================================  =========================================
situation                                              what runs
=====================================================  =========================================
module sets ``sac_legacy_checkpoint = True``            reentrant ``torch.utils.checkpoint``;
                                                       ``keep`` ignored (reported once)
traced by an outer ``torch.compile``                   scope markers carrying this site's keep
                                                       set; no eager checkpoint
... inside a checkpoint, by a backend without the      a non-reentrant checkpoint keeping the
pass                                                   regions through PyTorch's selective
                                                       checkpointing (policy_checkpoint.py)
the layer's ``forward`` compiled by the user (its      the seam's compile of it, with the user's
class's, or the instance's)                            options and backend: its graph is the
                                                       scope (compiled_forward.py); no eager
                                                       checkpoint
``compile=True`` (or a dict of compile options)        the module compiled with the memoised
                                                       ``make_sac_backend(keep)``, one scope; no
                                                       eager checkpoint around it
eager, empty ``keep``                                  plain non-reentrant checkpoint (full
                                                       recompute, behaviour-preserving)
eager, non-empty ``keep``                              the eager engine (:mod:`sac_compile.eager`)
=====================================================  =========================================

``fully_shard`` goes outside: ``fully_shard(apply_selective_checkpointing(layer, keep))``.

While a program is exported or traced for inference (``torch.export``, ONNX,
``torch.jit.trace``) a wrapped module runs its plain call: no checkpoint, no scope
markers (Note [markers export as nothing] in :mod:`sac_compile.markers.regions`).

A wrapped module pickles (``torch.save`` / ``torch.load(weights_only=False)``) and
deep-copies with its wrapping: the generated class is rebuilt from the original class and
the configuration, and a ``compile=True`` module is compiled again. :func:`remove_selective_checkpointing`
undoes the wrapping.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, SupportsIndex, cast

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from . import policy_checkpoint
from ._compat import frames
from ._compat import transformers as transformers_layers
from ._compat.dynamo import drop_compiled_call, has_compiled_call, unwrap_compiled
from ._compat.nn import CALL_IMPL, next_call_impl
from .arguments import Compile, SeamConfig
from .compiled_forward import FORWARD_SCOPE, USER_FORWARD, forward_is_scope
from .compiler.adopt import backend_and_compile_kwargs, calling, scope_compile
from .declare import undeclare_regions
from .diagnostics import eager as diagnosed
from .eager import checkpoint_with_regions
from .eager.routing import route_submodules, routed_compiled_methods, unroute_submodules
from .keep import ALL_REGIONS, Keep, Regions
from .markers import LEGACY_ATTR, SEAM_CALL_PREFIX, exporting, seam_scope_args
from .policy import SAVE_COSTLY, RegionPolicy, validate_policy
from .records import SEAM_PREFIX, user_class_name

__all__ = [
    "LEGACY_ATTR",
    "SeamConfig",
    "apply_selective_checkpointing",
    "is_container",
    "remove_selective_checkpointing",
    "wrap",
]


Args = tuple[Any, ...]  # a call's positional arguments
Kwargs = dict[str, Any]  # ... and keyword arguments
_SUBCLASSES: dict[tuple[Any, ...], type[nn.Module]] = {}  # (class, routed methods, config) -> subclass


def is_container(module: nn.Module) -> bool:
    """A module without a forward of its own (``ModuleList``, ``ModuleDict``, ``ParameterList``...):
    its children are called by its parent, never through it."""
    return getattr(type(module).forward, "__code__", None) is nn.Module.forward.__code__


def apply_selective_checkpointing(
    module: nn.Module,
    keep: Keep = (),
    *,
    preserve_rng_state: bool = True,
    compile: Compile = False,
    policy: RegionPolicy = SAVE_COSTLY,
    budget: float | None = None,
    offload: Regions = (),
) -> nn.Module:
    """Checkpoint ``module`` keeping the regions in ``keep``; returns ``module`` itself.

    Args:
        module: the layer to checkpoint (wrapped in place; see the decision table in
            this module's docstring).
        keep: region names to keep (save), ``sac_compile.ALL_REGIONS``, or ``()`` for
            full recompute.
        policy: the region policy (:mod:`sac_compile.policy`), the same in every mode;
            default :data:`~sac_compile.SAVE_COSTLY` (a kept region's costly values
            saved, its cheap ops recomputed).
        budget: fraction of the layer's activation bytes for PyTorch's knapsack to
            fill after the kept values (compiled code only: with ``compile=True`` or
            under an outer ``torch.compile``; the eager engine raises).
        offload: region names whose values are saved to host memory in the forward and
            brought back for the backward (compiled: PyTorch's partitioner offload pass;
            eager: the engine's cache; a region named in ``keep`` too is a ``ValueError``).
        preserve_rng_state: replay the RNG in the recompute (eager modes).
        compile: ``True`` or a dict with any of ``fullgraph``, ``dynamic``, ``mode``,
            ``options`` (for ``torch.compile``) and ``inner``, ``inductor_config`` (for
            ``make_sac_backend``): compile the module as one checkpoint scope.

    Wrapping an already wrapped module with the same arguments returns it unchanged;
    with different arguments it is a ``ValueError`` (never silently nested).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"apply_selective_checkpointing wraps an nn.Module, got {type(module).__name__}")
    if is_container(module):
        raise TypeError(
            f"apply_selective_checkpointing cannot wrap a {type(module).__name__}: it has no forward, so its "
            "call never runs and wrapping it would checkpoint nothing. Wrap each layer in it: "
            "`for layer in model.layers: apply_selective_checkpointing(layer, keep=...)`, or "
            "SacConfig(layers='layers.*', ...)"
        )
    config = SeamConfig.of(
        keep,
        policy=policy,
        budget=budget,
        offload=offload,
        preserve_rng_state=preserve_rng_state,
        compile=compile,
    )
    return wrap(module, config)


def wrap(module: nn.Module, config: SeamConfig) -> nn.Module:
    """:func:`apply_selective_checkpointing` with its arguments checked already (``config``)."""
    existing = getattr(module, "_sac_seam", None)
    if existing is not None:
        if existing == config:
            if not has_compiled_call(module):
                _compile(module, config)  # a copy that lost its compiled call (see compile-fallback)
            return module
        raise ValueError(
            f"{type(module).__name__} is already wrapped by apply_selective_checkpointing with "
            f"{_described(existing)}; wrapping it again with {_described(config)} would nest two "
            "checkpoints. Wrap each module once."
        )
    if has_compiled_call(module):
        raise ValueError(
            f"{type(module).__name__} was already compiled with module.compile(); apply "
            "apply_selective_checkpointing first (or pass compile=True to it)"
        )
    if config.compile_options is not None:
        backend_and_compile_kwargs(config)  # bad mode / options fail here, not at the first call
    cast(Any, module)._sac_seam = config
    module.__class__ = _subclass_for(type(module), config)
    _compile(module, config)
    forward_is_scope(module, config)  # an instance forward compiled before wrapping
    route_submodules(module)  # Note [compiled methods inside the seam] in sac_compile/eager/routing.py
    return module


def remove_selective_checkpointing(module: nn.Module) -> nn.Module:
    """Undo :func:`apply_selective_checkpointing` and :func:`~sac_compile.declare_regions`
    on ``module`` and every module under it; returns ``module``.

    Each wrapped module gets its original class back (and loses the compile that
    ``compile=True`` added); every declared region is removed. ``state_dict`` keys and
    parameters are untouched. Markers written in the model's code (``region``) stay:
    outside a checkpoint they do nothing. A model wrapped by ``torch.compile`` is undone
    through the module it wraps (the outer compile stays).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"remove_selective_checkpointing takes an nn.Module, got {type(module).__name__}")
    root = unwrap_compiled(module)
    for sub in root.modules():
        config = sub.__dict__.get("_sac_seam")
        if config is None:
            continue
        if type(sub).__dict__.get("_sac_seam_class") is not True:
            raise ValueError(
                f"{type(sub).__name__} was wrapped again after apply_selective_checkpointing (its class is "
                f"{type(sub).__qualname__}, e.g. by fully_shard), so the checkpointing cannot be taken out "
                "from under it; remove the outer wrapping first"
            )
        sub.__class__ = type(sub).__mro__[1]
        del sub._sac_seam
        if USER_FORWARD in sub.__dict__:
            sub.__dict__["forward"] = sub.__dict__.pop(USER_FORWARD)
        if config.compile_options is not None:
            drop_compiled_call(sub)
    unroute_submodules(root)
    undeclare_regions(root)
    return module


def _described(config: SeamConfig) -> str:
    return f"{config.actions.arguments()}, compile={config.compile_options}"


def _compile(module: nn.Module, config: SeamConfig) -> None:
    """Compile a ``compile=...`` wrap (at wrapping, and again when it is unpickled or copied:
    ``nn.Module.__getstate__`` drops the compiled call)."""
    if config.compile_options is not None:
        backend, kwargs = backend_and_compile_kwargs(config)
        module.compile(backend=backend, **kwargs)


# the generated class's attribute holding its transformers cache-argument positions
_CACHE_ARGS = "_sac_cache_args"


def _subclass_for(cls: type[nn.Module], config: SeamConfig) -> type[nn.Module]:
    """The generated subclass of ``cls`` whose ``_call_impl`` applies the seam."""
    routed = routed_compiled_methods(cls)  # Note [compiled methods inside the seam]
    key = (
        cls,
        # (a method compiled again, by another backend, is another class)
        tuple(sorted((name, id(fn.__wrapped__)) for name, fn in routed.items())),
        config.actions.text,
        config.preserve_rng_state,
        repr(config.compile_options),
    )
    if key not in _SUBCLASSES:
        # A fresh code object per class and configuration: Dynamo keys its cache
        # (and its recompile_limit of 8 entries) on code objects, and each backend
        # needs its own entries, so distinct layer classes or keep sets do not share
        # (and exhaust) one budget and silently run eagerly.
        call_impl = frames.fresh_function(_seam_call_impl, f"{SEAM_CALL_PREFIX}{cls.__name__}")
        forward: dict[str, Any] = {}
        if "forward" in routed and config.compile_options is None:
            # Note [a compiled forward is the layer's scope] in sac_compile/compiled_forward.py
            user = routed.pop("forward").__wrapped__
            forward = {"forward": calling(scope_compile(user, config.actions, f"{cls.__qualname__}.forward"))}
        _SUBCLASSES[key] = cast(
            "type[nn.Module]",
            type(
                f"{SEAM_PREFIX}{cls.__name__}",
                (cls,),
                {
                    **routed,
                    **forward,
                    FORWARD_SCOPE: bool(forward),
                    CALL_IMPL: call_impl,
                    "__module__": cls.__module__,
                    "_sac_seam_class": True,
                    _CACHE_ARGS: transformers_layers.cache_positions(cls),
                    "__reduce_ex__": _seam_reduce_ex,
                    "__setstate__": _seam_setstate,
                },
            ),
        )
    return _SUBCLASSES[key]


# Pickling and deep copies. The generated class cannot be found by name in its module, so a
# wrapped module pickles as "the original class, wrapped with this config": _rewrapped makes
# the instance of the generated class, pickle (or copy) restores its state, _seam_setstate
# compiles it again. Module.__getstate__ drops the compiled call, which is why a plain
# deepcopy of a compile=True module ran eagerly.


def _seam_class(module: nn.Module) -> type[Any]:
    """The generated class in ``module``'s MRO (``fully_shard`` may have put a subclass on top)."""
    for klass in type(module).__mro__:
        if "_sac_seam_class" in klass.__dict__:
            return klass
    raise TypeError(f"{type(module).__name__} is not wrapped by apply_selective_checkpointing")


def _seam_reduce_ex(self: nn.Module, protocol: SupportsIndex) -> str | tuple[Any, ...]:
    klass = type(self)
    if klass.__dict__.get("_sac_seam_class") is not True:  # a class made from ours (fully_shard): its own way
        return object.__reduce_ex__(self, protocol)
    return _rewrapped, (klass.__mro__[1], self._sac_seam), self.__getstate__()  # type: ignore[no-untyped-call]


def _rewrapped(cls: type[nn.Module], config: SeamConfig) -> nn.Module:
    validate_policy(config.actions.policy)  # a user's policy is registered in this process too
    klass = _subclass_for(cls, config)
    return klass.__new__(klass)


def _seam_setstate(self: nn.Module, state: dict[str, Any]) -> None:
    super(_seam_class(self), self).__setstate__(state)
    _compile(self, cast(SeamConfig, self._sac_seam))
    route_submodules(self)  # (pickled as their original classes)


def _seam_call_impl(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    config = cast(SeamConfig, self._sac_seam)
    # The original class's call (hooks included) is the next one after the
    # generated class in the MRO; fully_shard may have swapped in a subclass.
    call = next_call_impl(_seam_class(self), self)
    if exporting():  # See Note [markers export as nothing] in sac_compile/markers/regions.py.
        return call(*args, **kwargs)
    if torch.is_grad_enabled() and transformers_layers.is_checkpointing_layer(self):
        # train or eval mode alike: the seam checkpoints whenever grad is on
        args, kwargs = _transformers_training_call(self, args, kwargs)
    legacy = getattr(self, LEGACY_ATTR, False) is True
    if torch.compiler.is_compiling():
        if not legacy and policy_checkpoint.applies(config.actions.text):
            # Note [a seam inside a checkpoint compiled without the pass] in sac_compile/policy_checkpoint.py
            return policy_checkpoint.run(call, args, kwargs, config.actions, config.preserve_rng_state)
        # See Note [straight-line under compile] in sac_compile/markers/regions.py.
        scope_id, keep_text = seam_scope_args(self)
        torch.ops.sac_compile.scope_enter(scope_id, keep_text)
        out = call(*args, **kwargs)
        torch.ops.sac_compile.scope_exit(scope_id, keep_text)
        return out
    if not legacy and forward_is_scope(self, config):
        # the compiled forward is the checkpoint scope: no eager checkpoint around it
        # (Note [a compiled forward is the layer's scope] in sac_compile/compiled_forward.py)
        return call(*args, **kwargs)
    if config.compile_options is not None:
        diagnosed.report_compile_fallback(self)
        # Reached when Dynamo did not compile this call (a graph break it could not
        # resume, the recompile limit): we may still be inside torch.compile's dynamic
        # extent, where Dynamo would try to trace the eager engine's checkpoint (and
        # fail on its context_fn instead of running the layer). Run it eagerly.
        return _eager_uncompiled()(self, config, call, legacy, args, kwargs)
    return _eager(self, config, call, legacy, args, kwargs)


def _transformers_training_call(self: nn.Module, args: Args, kwargs: Kwargs) -> tuple[Args, Kwargs]:
    """A transformers layer checkpointed (grad enabled, in train or eval mode): cache writes off, as under
    transformers' own checkpointing (:mod:`sac_compile._compat.transformers`); refused when that
    checkpointing is on too (two nested checkpoints)."""
    if transformers_layers.own_checkpointing_on(self):
        raise ValueError(_twice_message(self))
    args, kwargs, turned = transformers_layers.training_call(
        self, args, kwargs, getattr(type(self), _CACHE_ARGS)
    )
    if turned and not torch.compiler.is_compiling():
        transformers_layers.note_caches_off(user_class_name(type(self)), turned)
    return args, kwargs


def _twice_message(module: nn.Module) -> str:
    return (
        f"{user_class_name(type(module))} is checkpointed twice: by sac_compile (apply_selective_checkpointing / "
        "SacConfig) and by transformers' own activation checkpointing (gradient_checkpointing=True: "
        "model.activation_checkpointing_enable(), TrainingArguments(gradient_checkpointing=True)), which "
        "would nest a full-recompute checkpoint inside the selective one. Use one: either call "
        "model.activation_checkpointing_disable(), or drop the SacConfig and turn transformers' switch on "
        "with activation_checkpointing_kwargs=sac_compile.hf.checkpointing_kwargs(model, keep=...)"
    )


def _where(self: nn.Module, args: Args, kwargs: Kwargs) -> tuple[str, str]:
    """The layer a recompute error names, and what to say of its cache arguments (a cache
    written in the forward is written again in the recompute, which then runs other ops)."""
    caches = transformers_layers.cache_arguments(args, kwargs)
    hint = ""
    if caches:
        hint = (
            f". It was called with the cache {', '.join(caches)}: a cache written in the forward is written "
            "again in the recompute; call the layer without one while training (use_cache=False)"
        )
    return user_class_name(type(self)), hint


def _eager(
    self: nn.Module, config: SeamConfig, call: Callable[..., Any], legacy: bool, args: Args, kwargs: Kwargs
) -> Any:
    diagnosed.report_compiled_inside(self)
    if legacy:
        diagnosed.report_legacy(self, config.actions.keep, LEGACY_ATTR)
        if kwargs:
            # (reentrant checkpointing passes positional arguments only, and would take
            # `early_stop` / `determinism_check` for its own without a word)
            raise TypeError(
                f"{type(self).__name__} has {LEGACY_ATTR}=True, so it runs under reentrant "
                "torch.utils.checkpoint, which passes positional arguments only; it was called "
                f"with keyword argument(s) {', '.join(sorted(kwargs))}. Pass them positionally, or "
                f"drop {LEGACY_ATTR} to run it under the non-reentrant engine"
            )
        return checkpoint(
            call, *args, use_reentrant=True, preserve_rng_state=config.preserve_rng_state, **kwargs
        )
    if not torch.is_grad_enabled():
        return call(*args, **kwargs)
    actions = config.actions
    fix = "Pass compile=True to apply_selective_checkpointing (or compile the model)"
    actions.refuse_budget_eagerly(type(self).__name__, fix)
    if kwargs:
        # The layer's keyword arguments are bound here, not handed through the
        # checkpoint's **kwargs, where torch.utils.checkpoint would take `debug`,
        # `early_stop`, `determinism_check` or `context_fn` for its own (and we `keep`,
        # `policy`). A non-reentrant checkpoint needs no tensor among its arguments.
        call = functools.partial(call, **kwargs)
    if actions.saving is not ALL_REGIONS and not actions.saving:
        return checkpoint(call, *args, use_reentrant=False, preserve_rng_state=config.preserve_rng_state)
    engine_kwargs: dict[str, Any] = {
        "keep": actions.keep,
        "policy": actions.policy,
        "offload": actions.offload,
        "preserve_rng_state": config.preserve_rng_state,
        "where": _where(self, args, kwargs),
    }
    if diagnosed.engine_done(self, actions.saving):
        return checkpoint_with_regions(call, *args, **engine_kwargs)
    stats: list[Any] = []
    out = checkpoint_with_regions(call, *args, **engine_kwargs, stats_out=stats)
    diagnosed.check_engine_call(self, actions.saving, stats[0])
    return out


@functools.cache
def _eager_uncompiled() -> Callable[..., Any]:
    """:func:`_eager` that Dynamo never traces (made on first use: torch.compiler.disable
    imports Dynamo, which `import sac_compile` must not)."""
    disabled: Callable[..., Any] = torch.compiler.disable(_eager, recursive=True)  # type: ignore[no-untyped-call]
    return disabled
