"""``SacConfig``: one frozen, validated description of how a model is checkpointed.

The shape of a training framework's ``recompute_cfg``: which modules are the
checkpointed layers, which regions to keep, where the regions are (declared by
module path), whether each layer is compiled, and whether diagnostics are errors.

>>> cfg = SacConfig(
...     layers="model.layers.*",
...     keep={"attn", "experts"},
...     regions={"model.layers.*.self_attn": "attn", "model.layers.*.mlp.experts": "experts"},
...     compile=True,
... )
>>> model = cfg.apply(model)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn

from . import diagnostics
from ._compat.dynamo import unwrap_compiled
from .arguments import Compile, SeamConfig, check_bool, check_pattern
from .declare import declare_regions, match_path, no_match_message
from .keep import KeepSet, normalize_keep, validate_region_name
from .policy import SAVE_COSTLY, RegionPolicy
from .seam import is_container, wrap

__all__ = ["SacConfig"]


@dataclass(frozen=True)
class SacConfig:
    """How to checkpoint a model; ``apply(model)`` does it in one call.

    Attributes:
        layers: module path pattern of the checkpointed layers (one checkpoint
            scope each), e.g. ``"model.layers.*"``; ``*`` matches one component. A
            tuple of patterns checkpoints several stacks (a vision tower's blocks and
            a language decoder's layers); each pattern must match some module.
        keep: region names to keep (save), or ``ALL_REGIONS``; ``()`` = full recompute.
        stack_keep: ``{pattern of layers: keep set}`` for the patterns whose layers
            keep something other than ``keep`` (keep attention in the language
            decoder only: ``stack_keep={"model.visual.blocks.*": ()}``); every key is
            one of ``layers``.
        regions: ``{module path pattern: region name}`` passed to ``declare_regions``.
        compile: ``False``, ``True`` or a dict of options (``fullgraph``,
            ``dynamic``, ``inner``, ``inductor_config``): compile each layer with
            the sac backend (see ``apply_selective_checkpointing``).
        preserve_rng_state: replay the RNG in eager recomputes.
        strict: raise every diagnosis for this model as an error.
        policy: the region policy (:mod:`sac_compile.policy`); default ``SAVE_COSTLY``.
        budget: activation-memory fraction for PyTorch's knapsack after the kept
            values (compiled layers only; see ``apply_selective_checkpointing``).
        offload: region names whose values go to host memory and come back for the
            backward (compiled and eager; disjoint from every keep set).
    """

    layers: str | tuple[str, ...]
    # (keep, regions and stack_keep are normalized by __post_init__ to a KeepSet and tuples)
    keep: KeepSet | Collection[str] = frozenset()
    regions: tuple[tuple[str, str], ...] | Mapping[str, str] = ()
    stack_keep: tuple[tuple[str, KeepSet], ...] | Mapping[str, Any] = ()
    compile: Compile = False
    preserve_rng_state: bool = True
    strict: bool = False
    policy: RegionPolicy = SAVE_COSTLY
    budget: float | None = None
    offload: Collection[str] = frozenset()
    # pattern of layers -> how its layers are checkpointed (every argument above, checked once)
    _seams: tuple[tuple[str, SeamConfig], ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        patterns = self.layers if isinstance(self.layers, tuple) else (self.layers,)
        if (
            not patterns
            or not all(isinstance(p, str) and p for p in patterns)
            or len(set(patterns)) < len(patterns)
        ):
            raise TypeError(
                "SacConfig.layers must be a non-empty module path pattern such as 'model.layers.*', or a "
                f"tuple of distinct ones (one per stack of layers), got {self.layers!r}"
            )
        for pattern in patterns:
            check_pattern(pattern)
        object.__setattr__(self, "keep", normalize_keep(self.keep))
        object.__setattr__(self, "stack_keep", _stack_keep(self.stack_keep, patterns))
        regions = self.regions
        if isinstance(regions, Mapping):
            regions = tuple(regions.items())
        if not isinstance(regions, tuple) or not all(isinstance(r, tuple) and len(r) == 2 for r in regions):
            raise TypeError(
                "SacConfig.regions must be a mapping {module path pattern: region name}, "
                f"got {self.regions!r}"
            )
        for pattern, name in regions:
            check_pattern(pattern)
            validate_region_name(name)
        object.__setattr__(self, "regions", tuple(sorted(regions)))
        keeps = dict(self.stack_keep)
        seams = tuple(
            (p, SeamConfig.of(keeps.get(p, self.keep), **self._layer_arguments())) for p in patterns
        )
        object.__setattr__(self, "_seams", seams)
        first = seams[0][1]
        if isinstance(self.compile, Mapping):  # a hashable tuple, so that the config stays frozen
            object.__setattr__(self, "compile", first.compile_options)
        object.__setattr__(self, "policy", first.actions.policy)
        object.__setattr__(self, "budget", first.actions.budget)
        object.__setattr__(self, "offload", first.actions.offload)
        check_bool(self.strict, "SacConfig.strict")

    def _layer_arguments(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "budget": self.budget,
            "offload": self.offload,
            "preserve_rng_state": self.preserve_rng_state,
            # (a dict of options is held as its normalized pairs: dataclasses.replace passes them back)
            "compile": dict(self.compile) if isinstance(self.compile, tuple) else self.compile,
        }

    def apply(self, model: nn.Module) -> nn.Module:
        """Declare the regions, wrap every matching layer, and return ``model``.

        Idempotent: applying the same config again changes nothing; applying a
        different one to already wrapped layers is a ``ValueError`` (from the seam).
        """
        if not isinstance(model, nn.Module):
            raise TypeError(f"SacConfig.apply takes an nn.Module, got {type(model).__name__}")
        root = unwrap_compiled(model)
        paths = [p for p, _ in root.named_modules()]
        seams = dict(self._seams)
        layers = []  # (module, how it is checkpointed), every pattern's layers
        for pattern in self.patterns:
            matched = [(p, m) for p, m in root.named_modules() if match_path(pattern, p)]
            if not matched:
                raise ValueError(
                    no_match_message(pattern, paths).replace("declare_regions", "SacConfig.layers")
                )
            containers = [p for p, m in matched if is_container(m)]
            if containers:
                raise ValueError(
                    f"SacConfig.layers={pattern!r} matches {type(dict(matched)[containers[0]]).__name__} "
                    f"{containers[0]!r}, a container without a forward: its call never runs, so wrapping it "
                    f"would checkpoint nothing. Match the layers inside it: layers={_inside(pattern)!r}"
                )
            layers += [(m, seams[pattern]) for _, m in matched]
        if self.regions:
            declare_regions(root, dict(self.regions))
        for layer, seam in layers:
            wrap(layer, seam)
        if self.strict:
            diagnostics.make_strict(root)
        return model

    @property
    def patterns(self) -> tuple[str, ...]:
        """``layers`` as a tuple of patterns."""
        return self.layers if isinstance(self.layers, tuple) else (self.layers,)


def _stack_keep(value: Any, patterns: tuple[str, ...]) -> tuple[tuple[str, KeepSet], ...]:
    items = tuple(value.items()) if isinstance(value, Mapping) else value
    if not isinstance(items, tuple) or not all(isinstance(i, tuple) and len(i) == 2 for i in items):
        raise TypeError(
            f"SacConfig.stack_keep must be a mapping {{pattern of layers: keep set}}, got {value!r}"
        )
    for pattern, _ in items:
        if pattern not in patterns:
            raise ValueError(
                f"SacConfig.stack_keep names {pattern!r}, which is not one of layers={list(patterns)}: "
                "each key is the pattern of a stack of layers this config checkpoints"
            )
    return tuple(sorted(((p, normalize_keep(k)) for p, k in items), key=lambda item: item[0]))


def _inside(pattern: str) -> str:
    return f"{pattern}.*" if pattern else "*"
