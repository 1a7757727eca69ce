"""``apply_selective_checkpointing``: one call per wrap site, right in every mode.

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
``compile=True`` (or a dict of compile options)        the module compiled with the memoised
                                                       ``make_sac_backend(keep)``, one scope; no
                                                       eager checkpoint around it
eager, empty ``keep``                                  plain non-reentrant checkpoint (full
                                                       recompute, behaviour-preserving)
eager, non-empty ``keep``                              the eager engine (:mod:`sac_compile.eager`)
=====================================================  =========================================

``fully_shard`` goes outside: ``fully_shard(apply_selective_checkpointing(layer, keep))``.
"""

from __future__ import annotations

import types
import weakref
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from . import diagnostics
from .backend import make_sac_backend
from .eager import checkpoint_with_regions
from .keep import ALL_REGIONS, KeepSet, format_keep, normalize_keep
from .markers import LEGACY_ATTR, SEAM_CALL_PREFIX, seam_scope_args
from .policy import SAVE_COSTLY, RegionPolicy, format_scope, policy_key, validate_budget, validate_policy
from .records import SEAM_PREFIX, generic_path

__all__ = ["LEGACY_ATTR", "SeamConfig", "apply_selective_checkpointing", "is_wrapped"]


_COMPILE_KEYS = {"fullgraph", "dynamic"}
_BACKEND_KEYS = {"inner", "inductor_config"}


@dataclass(frozen=True)
class SeamConfig:
    keep: KeepSet
    preserve_rng_state: bool
    compile_options: tuple[tuple[str, Any], ...] | None  # None: not compiled by the seam
    policy: RegionPolicy = SAVE_COSTLY
    budget: float | None = None
    # the scope markers' text (keep set, policy key, budget), computed once here: a user
    # policy's key hashes its source, which Dynamo cannot trace (a graph break in the seam)
    scope_text: str = ""


_SUBCLASSES: dict[tuple, type] = {}
# Modules already checked for diagnoses (weakly held: ids are reused once a module dies);
# the diagnoses themselves are deduplicated per root module by sac_compile.diagnostics.
_legacy_checked: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_compiled_checked: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_fallback_checked: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_eager_calls: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()


def is_wrapped(module: nn.Module) -> bool:
    return isinstance(getattr(module, "_sac_seam", None), SeamConfig)


def is_container(module: nn.Module) -> bool:
    """A module without a forward of its own (``ModuleList``, ``ModuleDict``, ``ParameterList``...):
    its children are called by its parent, never through it."""
    return getattr(type(module).forward, "__code__", None) is nn.Module.forward.__code__


def apply_selective_checkpointing(
    module: nn.Module,
    keep: object = (),
    *,
    preserve_rng_state: bool = True,
    compile: bool | Mapping[str, Any] = False,
    policy: object = SAVE_COSTLY,
    budget: float | None = None,
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
        preserve_rng_state: replay the RNG in the recompute (eager modes).
        compile: ``True`` or a dict with any of ``fullgraph``, ``dynamic`` (for
            ``torch.compile``) and ``inner``, ``inductor_config`` (for
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
    keep_set = normalize_keep(keep)
    if not isinstance(preserve_rng_state, bool):
        raise TypeError(f"preserve_rng_state must be a bool, got {preserve_rng_state!r}")
    options = _compile_options(compile)
    policy, budget = validate_policy(policy), validate_budget(budget)
    scope_text = format_scope(format_keep(keep_set), policy, budget)
    config = SeamConfig(keep_set, preserve_rng_state, options, policy, budget, scope_text)
    existing = getattr(module, "_sac_seam", None)
    if existing is not None:
        if existing == config:
            return module
        raise ValueError(
            f"{type(module).__name__} is already wrapped by apply_selective_checkpointing with "
            f"keep={format_keep(existing.keep)!r}, compile={existing.compile_options}, "
            f"policy={policy_key(existing.policy)}, budget={existing.budget}; wrapping it again with "
            f"keep={format_keep(keep_set)!r}, compile={options}, policy={policy_key(config.policy)}, "
            f"budget={config.budget} would nest two checkpoints. "
            "Wrap each module once."
        )
    if getattr(module, "_compiled_call_impl", None) is not None:
        raise ValueError(
            f"{type(module).__name__} was already compiled with module.compile(); apply "
            "apply_selective_checkpointing first (or pass compile=True to it)"
        )
    module._sac_seam = config
    module.__class__ = _subclass_for(type(module), config)
    if options is not None:
        opts = dict(options)
        backend = make_sac_backend(
            keep_set,
            policy=config.policy,
            budget=config.budget,
            **{k: v for k, v in opts.items() if k in _BACKEND_KEYS},
        )
        module.compile(backend=backend, **{k: v for k, v in opts.items() if k in _COMPILE_KEYS})
    return module


def _compile_options(compile: object) -> tuple[tuple[str, Any], ...] | None:
    if compile is False:
        return None
    if compile is True:
        return ()
    if isinstance(compile, Mapping):
        unknown = set(compile) - _COMPILE_KEYS - _BACKEND_KEYS
        if unknown:
            raise ValueError(
                f"compile options {sorted(unknown)} are not understood; use "
                f"{sorted(_COMPILE_KEYS | _BACKEND_KEYS)}"
            )
        items = []
        for k, v in compile.items():
            if k == "inductor_config":
                v = tuple(sorted(dict(v).items()))
            items.append((k, v))
        return tuple(sorted(items))
    raise TypeError(f"compile must be a bool or a dict of options, got {type(compile).__name__} {compile!r}")


def _subclass_for(cls: type, config: SeamConfig) -> type:
    """The generated subclass of ``cls`` whose ``_call_impl`` applies the seam."""
    key = (
        cls,
        format_keep(config.keep),
        config.preserve_rng_state,
        repr(config.compile_options),
        policy_key(config.policy),
        config.budget,
    )
    if key not in _SUBCLASSES:
        # A fresh code object per class and configuration: Dynamo keys its cache
        # (and its recompile_limit of 8 entries) on code objects, and each backend
        # needs its own entries, so distinct layer classes or keep sets do not share
        # (and exhaust) one budget and silently run eagerly.
        template = _seam_call_impl
        code = template.__code__.replace(co_name=f"{SEAM_CALL_PREFIX}{cls.__name__}")
        call_impl = types.FunctionType(code, template.__globals__, code.co_name, template.__defaults__)
        _SUBCLASSES[key] = type(
            f"{SEAM_PREFIX}{cls.__name__}",
            (cls,),
            {"_call_impl": call_impl, "__module__": cls.__module__, "_sac_seam_class": True},
        )
    return _SUBCLASSES[key]


def _seam_call_impl(self, *args, **kwargs):
    config: SeamConfig = self._sac_seam
    # The original class's call (hooks included) is the next one after the
    # generated class in the MRO; fully_shard may have swapped in a subclass.
    for klass in type(self).__mro__:
        if "_sac_seam_class" in klass.__dict__:
            break
    call = super(klass, self)._call_impl
    legacy = getattr(self, LEGACY_ATTR, False) is True
    if torch.compiler.is_compiling():
        # Straight-line on purpose (no with-block): a graph break inside the layer
        # must not make Dynamo fall back for the whole frame; the graphs compiled below
        # this frame then find the scope on the stack (markers.enclosing_context).
        scope_id, keep_text = seam_scope_args(self)
        torch.ops.sac_compile.scope_enter(scope_id, keep_text)
        out = call(*args, **kwargs)
        torch.ops.sac_compile.scope_exit(scope_id, keep_text)
        return out
    if config.compile_options is not None:
        _report_compile_fallback(self)
        # Reached when Dynamo did not compile this call (a graph break it could not
        # resume, the recompile limit): we may still be inside torch.compile's dynamic
        # extent, where Dynamo would try to trace the eager engine's checkpoint (and
        # fail on its context_fn instead of running the layer). Run it eagerly.
        return _eager_uncompiled(self, config, call, legacy, args, kwargs)
    return _eager(self, config, call, legacy, args, kwargs)


def _eager(self, config: SeamConfig, call, legacy: bool, args: tuple, kwargs: dict):
    _report_compiled_inside(self)
    if legacy:
        _report_legacy(self, config)
        return checkpoint(
            call, *args, use_reentrant=True, preserve_rng_state=config.preserve_rng_state, **kwargs
        )
    if not torch.is_grad_enabled():
        return call(*args, **kwargs)
    if config.budget is not None:
        raise ValueError(
            f"{type(self).__name__} was wrapped with budget={config.budget:g}, but runs in the eager engine, "
            "which has no partitioner to spend a budget: budget= applies to compiled code only. Pass "
            "compile=True to apply_selective_checkpointing (or compile the model), or drop budget="
        )
    if config.keep is not ALL_REGIONS and not config.keep:
        return checkpoint(
            call, *args, use_reentrant=False, preserve_rng_state=config.preserve_rng_state, **kwargs
        )
    engine_kwargs = {
        "keep": config.keep,
        "policy": config.policy,
        "preserve_rng_state": config.preserve_rng_state,
    }
    if self in _eager_calls and _eager_calls[self] < 0:
        return checkpoint_with_regions(call, *args, **engine_kwargs, **kwargs)
    stats: list = []
    out = checkpoint_with_regions(call, *args, **engine_kwargs, stats_out=stats, **kwargs)
    _check_eager(self, config, stats[0])
    return out


_eager_uncompiled = torch.compiler.disable(_eager, recursive=True)


def _report_forced_collectives(stats, config: SeamConfig, where: str, owner: object) -> None:
    """Collectives the eager engine re-ran in the backward although their region is kept."""
    forced: dict[str, Counter] = {}
    for regions, op, was_forced in stats.collectives:
        for name in regions:
            if was_forced and (config.keep is ALL_REGIONS or name in config.keep):
                forced.setdefault(name, Counter())[op] += 1
    for name, ops_run in sorted(forced.items()):
        listed = ", ".join(f"{n} x {op}" for op, n in sorted(ops_run.items()))
        diagnostics.report(
            diagnostics.Diagnosis(
                diagnostics.COLLECTIVE_RECOMPUTED,
                name,
                where,
                f"it is kept, but the eager engine recomputes the collectives in it ({listed} per call), "
                "so the backward communicates again: their output buffers may be written outside the "
                "region, so eager mode never serves them from a cache. A compiled layer "
                "(compile=True, or a sac backend) saves kept functional collectives instead.",
            ),
            owner,
        )


def _check_eager(module: nn.Module, config: SeamConfig, stats) -> None:
    """Diagnoses of one eager engine call (until the module has been checked twice)."""
    owner = diagnostics.owner_on_stack(2)
    where = _where(module, owner)
    diagnostics.note_regions(stats.regions_entered, owner)
    calls = _eager_calls.get(module, 0) + 1
    if calls == 1:
        held = {name for key in stats.held_by_region for name in key.split("+")}
        for name in sorted(stats.regions_entered):
            if (config.keep is ALL_REGIONS or name in config.keep) and name not in held:
                diagnostics.report(
                    diagnostics.Diagnosis(
                        diagnostics.KEPT_NOTHING,
                        name,
                        where,
                        "it is kept, but after the forward nothing computed in it is held: the region "
                        "policy saved none of its ops (no costly op - matmul, convolution, attention, "
                        "custom kernel - ran in it; cheap ops, views, collectives and in-place targets "
                        "are recomputed), or the backward reads none of its values. Keeping it saves "
                        "nothing: mark the op whose output the backward needs, or drop the name from keep.",
                    ),
                    owner,
                )
        _report_forced_collectives(stats, config, where, owner)
        for name, how in sorted(set(stats.unbalanced)):
            diagnostics.report(
                diagnostics.Diagnosis(
                    diagnostics.UNBALANCED,
                    name,
                    where,
                    f"{how} inside the checkpointed call: "
                    + (
                        "the region stayed open to the end of the layer"
                        if how == "enter without exit"
                        else "the exit was ignored"
                    )
                    + ". Use region(...) as a with-block or decorator so that enter and exit pair up.",
                ),
                owner,
            )
    _eager_calls[module] = calls  # after reporting: a strict error does not count the call
    explicit = () if config.keep is ALL_REGIONS else tuple(config.keep)
    if explicit and calls < 2:
        return  # judged on a repeat, once the rest of the model has run
    names = diagnostics.unrecorded(explicit, owner)
    if names:
        diagnostics.report(diagnostics.keep_unused(names, where), owner)
    _eager_calls[module] = -1  # checked


def _where(module: nn.Module, owner: object) -> str:
    """``Block (layers.*)``: the module's class and its path in the root, indices generalised."""
    path = None
    if isinstance(owner, nn.Module):
        path = next((name for name, sub in owner.named_modules() if sub is module), None)
    if path is not None:
        path = generic_path(path) or "<root>"
    return diagnostics.describe_module(module, path)


def _report_compiled_inside(module: nn.Module) -> None:
    """A compiled submodule inside this eager checkpoint: its saved tensors are discarded."""
    if module in _compiled_checked:
        return
    _compiled_checked.add(module)
    compiled = [
        name
        for name, sub in module.named_modules()
        if name and getattr(sub, "_compiled_call_impl", None) is not None
    ]
    if compiled:
        owner = diagnostics.owner_on_stack(3)
        diagnostics.report(
            diagnostics.Diagnosis(
                diagnostics.COMPILED_IN_EAGER,
                "-",
                _where(module, owner),
                f"it is checkpointed eagerly but contains compiled code ({', '.join(compiled)}): the "
                "compiled graph's saved tensors are discarded and it is recomputed whole in the backward. "
                "Pass compile=True to apply_selective_checkpointing instead, or compile the whole model.",
            ),
            owner,
        )


def _report_compile_fallback(module: nn.Module) -> None:
    """A layer wrapped with compile=True is running eagerly: Dynamo did not compile it."""
    if module in _fallback_checked:
        return
    _fallback_checked.add(module)
    owner = diagnostics.owner_on_stack(3)
    diagnostics.report(
        diagnostics.Diagnosis(
            diagnostics.COMPILE_FALLBACK,
            "-",
            _where(module, owner),
            "it was wrapped with compile=True but runs eagerly: Dynamo did not compile its call (recompile "
            "limit reached, the frame was skipped, or compiling is disabled), so the eager engine checkpoints "
            "it instead (correct, slower). See TORCH_LOGS=recompiles,graph_breaks.",
        ),
        owner,
    )


def _report_legacy(module: nn.Module, config: SeamConfig) -> None:
    if module in _legacy_checked:
        return
    _legacy_checked.add(module)
    if config.keep is ALL_REGIONS or config.keep:
        owner = diagnostics.owner_on_stack(3)
        diagnostics.report(
            diagnostics.Diagnosis(
                diagnostics.LEGACY_KEEP_IGNORED,
                format_keep(config.keep),
                _where(module, owner),
                f"it sets {LEGACY_ATTR}=True, so it is checkpointed reentrantly and keep="
                f"{format_keep(config.keep)!r} is ignored (every op in it is recomputed)",
            ),
            owner,
        )
