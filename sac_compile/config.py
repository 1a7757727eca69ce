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

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn

from . import diagnostics
from ._compat.dynamo import unwrap_compiled
from .declare import check_pattern, declare_regions, match_path, no_match_message
from .keep import KeepSet, normalize_keep, validate_region_name
from .policy import SAVE_COSTLY, validate_policy
from .scope_text import validate_budget
from .seam import apply_selective_checkpointing, is_container, normalize_compile

__all__ = ["SacConfig"]


@dataclass(frozen=True)
class SacConfig:
    """How to checkpoint a model; ``apply(model)`` does it in one call.

    Attributes:
        layers: module path pattern of the checkpointed layers (one checkpoint
            scope each), e.g. ``"model.layers.*"``; ``*`` matches one component.
        keep: region names to keep (save), or ``ALL_REGIONS``; ``()`` = full recompute.
        regions: ``{module path pattern: region name}`` passed to ``declare_regions``.
        compile: ``False``, ``True`` or a dict of options (``fullgraph``,
            ``dynamic``, ``inner``, ``inductor_config``): compile each layer with
            the sac backend (see ``apply_selective_checkpointing``).
        preserve_rng_state: replay the RNG in eager recomputes.
        strict: raise every diagnosis for this model as an error.
        policy: the region policy (:mod:`sac_compile.policy`); default ``SAVE_COSTLY``.
        budget: activation-memory fraction for PyTorch's knapsack after the kept
            values (compiled layers only; see ``apply_selective_checkpointing``).
    """

    layers: str
    keep: KeepSet = frozenset()
    regions: tuple[tuple[str, str], ...] = ()
    compile: Any = False
    preserve_rng_state: bool = True
    strict: bool = False
    policy: Any = SAVE_COSTLY
    budget: float | None = None
    _compile_options: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.layers, str) or not self.layers:
            raise TypeError(
                f"SacConfig.layers must be a non-empty module path pattern such as 'model.layers.*', "
                f"got {self.layers!r}"
            )
        check_pattern(self.layers)
        object.__setattr__(self, "keep", normalize_keep(self.keep))
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
        # validates; a dict becomes a hashable tuple so that the config stays frozen
        object.__setattr__(self, "_compile_options", normalize_compile(self.compile))
        if isinstance(self.compile, Mapping):
            object.__setattr__(self, "compile", self._compile_options)
        object.__setattr__(self, "policy", validate_policy(self.policy))
        object.__setattr__(self, "budget", validate_budget(self.budget))
        for attr in ("preserve_rng_state", "strict"):
            if not isinstance(getattr(self, attr), bool):
                raise TypeError(f"SacConfig.{attr} must be a bool, got {getattr(self, attr)!r}")

    def apply(self, model: nn.Module) -> nn.Module:
        """Declare the regions, wrap every matching layer, and return ``model``.

        Idempotent: applying the same config again changes nothing; applying a
        different one to already wrapped layers is a ``ValueError`` (from the seam).
        """
        if not isinstance(model, nn.Module):
            raise TypeError(f"SacConfig.apply takes an nn.Module, got {type(model).__name__}")
        root = unwrap_compiled(model)
        layers = [(p, m) for p, m in root.named_modules() if match_path(self.layers, p)]
        if not layers:
            raise ValueError(
                no_match_message(self.layers, [p for p, _ in root.named_modules()]).replace(
                    "declare_regions", "SacConfig.layers"
                )
            )
        containers = [p for p, m in layers if is_container(m)]
        if containers:
            raise ValueError(
                f"SacConfig.layers={self.layers!r} matches {type(dict(layers)[containers[0]]).__name__} "
                f"{containers[0]!r}, a container without a forward: its call never runs, so wrapping it "
                f"would checkpoint nothing. Match the layers inside it: layers={_inside(self.layers)!r}"
            )
        if self.regions:
            declare_regions(root, dict(self.regions))
        compile_arg: Any = False
        if self._compile_options is not None:
            compile_arg = dict(self._compile_options) or True
            if isinstance(compile_arg, dict) and "inductor_config" in compile_arg:
                compile_arg["inductor_config"] = dict(compile_arg["inductor_config"])
        for _, layer in layers:
            apply_selective_checkpointing(
                layer,
                keep=self.keep,
                preserve_rng_state=self.preserve_rng_state,
                compile=compile_arg,
                policy=self.policy,
                budget=self.budget,
            )
        if self.strict:
            diagnostics.make_strict(root)
        return model


def _inside(pattern: str) -> str:
    return f"{pattern}.*" if pattern else "*"
