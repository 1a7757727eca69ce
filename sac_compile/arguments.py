"""Every entry point's arguments, checked in one place before any work.

A layer's checkpointing is one frozen value, :class:`SeamConfig` (its :class:`Actions` --
keep, offload, policy, budget --, ``preserve_rng_state`` and the ``compile=`` options), made
by :meth:`SeamConfig.of` from the arguments ``apply_selective_checkpointing`` and
``SacConfig`` take; ``region_context_fn``, ``make_sac_backend`` and the eager engine check
theirs with :meth:`Actions.of <sac_compile.actions.Actions.of>` and :func:`check_bool`; module
path patterns (``SacConfig.layers`` / ``regions``, ``declare_regions``) with
:func:`check_pattern`. Each check raises a ``TypeError`` / ``ValueError`` naming the value,
the rule and the fix.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypedDict

from .actions import Actions
from .keep import Keep, Regions
from .policy import SAVE_COSTLY, RegionPolicy

__all__ = [
    "BACKEND_KEYS",
    "COMPILE_KEYS",
    "Compile",
    "CompileOptions",
    "SeamConfig",
    "check_bool",
    "check_pattern",
    "normalize_compile",
]

# torch.compile's arguments; "mode" and "options" reach the backend, which forwards them to Inductor
COMPILE_KEYS = frozenset({"fullgraph", "dynamic", "mode", "options"})
BACKEND_KEYS = frozenset({"inner", "inductor_config"})
# compile options whose values are dicts (kept as sorted item tuples in SeamConfig)
DICT_KEYS = ("inductor_config", "options")


class CompileOptions(TypedDict, total=False):
    """A ``compile=`` dict: ``torch.compile``'s ``fullgraph``, ``dynamic``, ``mode``,
    ``options``, and ``make_sac_backend``'s ``inner``, ``inductor_config``."""

    fullgraph: bool
    dynamic: bool | None
    mode: str | None
    options: Mapping[str, Any]
    inner: str | Callable[..., Any]  # make_sac_backend's inner: a name or a backend object
    inductor_config: Mapping[str, Any]


#: What a ``compile=`` argument takes: ``False`` (eager), ``True`` (compiled with the
#: defaults) or :class:`CompileOptions`.
Compile = bool | CompileOptions


def check_bool(value: object, what: str) -> bool:
    """``value``, which must be a bool (``what`` names it: ``"preserve_rng_state"``)."""
    if not isinstance(value, bool):
        raise TypeError(f"{what} must be a bool, got {value!r}")
    return value


def normalize_compile(compile: object) -> tuple[tuple[str, Any], ...] | None:
    """A ``compile=`` argument as a hashable value: None (not compiled), ``()`` (the defaults)
    or the options as sorted ``(key, value)`` pairs (a dict value as sorted pairs too)."""
    if compile is False:
        return None
    if compile is True:
        return ()
    if isinstance(compile, Mapping):
        unknown = set(compile) - COMPILE_KEYS - BACKEND_KEYS
        if unknown:
            raise ValueError(
                f"compile options {sorted(unknown)} are not understood; use {sorted(COMPILE_KEYS | BACKEND_KEYS)}"
            )
        items = []
        for k, v in compile.items():
            if k in DICT_KEYS:
                v = tuple(sorted(dict(v).items()))
            items.append((k, v))
        return tuple(sorted(items))
    raise TypeError(f"compile must be a bool or a dict of options, got {type(compile).__name__} {compile!r}")


@dataclass(frozen=True)
class SeamConfig:
    """How one layer is checkpointed, checked: what :func:`~sac_compile.apply_selective_checkpointing`
    stores on the layer (``_sac_seam``) and a ``SacConfig`` makes for each of its stacks."""

    actions: Actions  # keep, offload, policy, budget (and the scope markers' text)
    preserve_rng_state: bool
    compile_options: tuple[tuple[str, Any], ...] | None  # None: not compiled by the seam

    @classmethod
    def of(
        cls,
        keep: Keep = (),
        *,
        policy: RegionPolicy = SAVE_COSTLY,
        budget: float | None = None,
        offload: Regions = (),
        preserve_rng_state: bool = True,
        compile: Compile = False,
    ) -> SeamConfig:
        """The arguments of ``apply_selective_checkpointing`` (and a ``SacConfig``'s), checked."""
        actions = Actions.of(keep, policy, budget, offload)
        return cls(actions, check_bool(preserve_rng_state, "preserve_rng_state"), normalize_compile(compile))

    def compile_kwargs(self) -> dict[str, Any]:
        """The ``compile=`` options as keyword arguments again (dict values as dicts)."""
        return {k: dict(v) if k in DICT_KEYS else v for k, v in (self.compile_options or ())}


def check_pattern(pattern: object) -> None:
    """A module path pattern as ``named_modules()`` writes paths, ``*`` standing for one whole
    component (``"model.layers.*.self_attn"``); ``""`` is the root module."""
    if not isinstance(pattern, str):
        raise TypeError(f"a module path pattern must be a str, got {type(pattern).__name__} {pattern!r}")
    if pattern == "":
        return  # the root module
    for part in pattern.split("."):
        if part == "":
            raise ValueError(
                f"module path pattern {pattern!r} has an empty component; write dotted paths as "
                "named_modules() reports them, e.g. 'model.layers.*.self_attn'"
            )
        if part != "*" and any(c in part for c in "*?[]"):
            raise ValueError(
                f"module path pattern {pattern!r}: {part!r} mixes a wildcard with text; '*' stands for "
                "one whole path component (e.g. 'layers.*.mlp'), list the modules explicitly otherwise"
            )
