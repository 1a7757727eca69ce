"""What a checkpoint scope does with its regions' values -- :class:`Actions`: the keep set,
the regions offloaded to host memory, the region policy and the partitioner's budget, one
frozen value from every entry point to
the compiled pass, the eager engine and the planner -- and the text its scope markers carry
(``Actions.text`` / ``Actions.from_text``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

from .keep import ALL_REGIONS, KeepSet, format_keep, normalize_keep, parse_keep
from .policy import SAVE_COSTLY, RegionPolicy, policy_key, resolve_policy, validate_policy

__all__ = ["Actions", "format_scope", "keep_of_text", "parse_scope", "validate_budget"]


def validate_budget(budget: object) -> float | None:
    """``budget`` as a float in (0, 1], or None for no budget.

    ``0`` means the same as no budget (save the kept regions' costly values and
    recompute everything else): PyTorch's own budget 0 saves only the graph's
    inputs, which would drop the kept values.
    """
    if budget is None:
        return None
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise TypeError(f"budget must be a float in [0, 1] or None, got {type(budget).__name__} {budget!r}")
    if not 0.0 <= float(budget) <= 1.0:
        raise ValueError(
            f"budget={budget!r} is outside [0, 1]; it is the fraction of a scope's activation bytes "
            "the partitioner may save (PyTorch's activation_memory_budget), e.g. budget=0.5"
        )
    return float(budget) or None


@dataclass(frozen=True)
class Actions:
    """A checkpoint scope's actions: the regions it keeps (``keep``: their costly values
    saved on the device), the regions it offloads (``offload``: their costly values saved
    to host memory in the forward and brought back for the backward), the policy deciding
    those regions' ops (``policy``), and the fraction of the scope's activation bytes
    PyTorch's knapsack may save beyond them (``budget``, compiled code only). Everything
    else is recomputed. A value in both a kept and an offloaded region stays on the device.

    Made once at each entry point (:meth:`of` validates the user's arguments) and handed
    on whole: the seam, the backend, the joint-graph pass, the eager engine and the planner
    read these fields and no copies of them. Equal actions compare equal (a policy by
    identity) and hash alike; ``text`` is the scope markers' payload (computed once here: a
    user policy's key hashes its source, which Dynamo cannot trace)."""

    keep: KeepSet = frozenset()
    policy: RegionPolicy = SAVE_COSTLY
    budget: float | None = None
    offload: frozenset[str] = frozenset()
    text: str = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "text", format_scope(format_keep(self.keep), self.policy, self.budget, self.offload)
        )

    @classmethod
    def of(
        cls, keep: object = (), policy: object = SAVE_COSTLY, budget: object = None, offload: object = ()
    ) -> Actions:
        """The actions a user's ``keep`` / ``policy`` / ``budget`` / ``offload`` arguments ask
        for, each checked (a clear ``TypeError`` / ``ValueError`` naming the value and the fix)."""
        keep_set = normalize_keep(keep)
        if offload is None or isinstance(offload, (str, bytes)):
            raise TypeError(
                f"offload must be a collection of region names, got {offload!r}; e.g. offload={{'mlp'}} "
                "(or offload=() to offload nothing)"
            )
        if offload is ALL_REGIONS:
            raise TypeError(
                "offload=ALL_REGIONS is not supported: name the regions to offload, e.g. "
                "offload={'mlp'}, and keep=() (a region is kept or offloaded, not both)"
            )
        offloaded = cast("frozenset[str]", normalize_keep(offload))
        names = None if keep_set is ALL_REGIONS else cast("frozenset[str]", keep_set)
        both = sorted(offloaded if names is None else offloaded & names)
        if both:
            kept = "keep=ALL_REGIONS" if names is None else f"keep={sorted(names)}"
            raise ValueError(
                f"{kept} and offload={sorted(offloaded)} both name {both}: a region's values are kept "
                "on the device or offloaded to host memory, not both; drop them from one of the two"
            )
        return cls(keep_set, validate_policy(policy), validate_budget(budget), offloaded)

    @staticmethod
    def from_text(text: str) -> Actions:
        """The actions a scope marker's ``text`` carries (inverse of ``.text``)."""
        keep_text, policy, budget = parse_scope(text)
        offload = _fields(text).get("offload", "")
        return Actions(
            parse_keep(keep_text),
            policy,
            validate_budget(budget),
            cast("frozenset[str]", parse_keep(offload)),  # (never "*": of() refuses ALL_REGIONS)
        )

    @property
    def saving(self) -> KeepSet:
        """The regions whose costly values are saved, on the device or on the host: what the
        region policy is asked with as its keep set."""
        if self.keep is ALL_REGIONS or not self.offload:
            return self.keep
        return cast("frozenset[str]", self.keep) | self.offload

    def offloads(self, regions: tuple[str, ...]) -> bool:
        """Whether a saved value computed with ``regions`` open goes to host memory."""
        return any(r in self.offload for r in regions) and not any(r in self.keep for r in regions)

    def without_budget(self) -> Actions:
        return Actions(self.keep, self.policy, None, self.offload)

    def arguments(self) -> str:
        """The keyword arguments that make these actions, as text (reprs, messages)."""
        keep = "ALL_REGIONS" if self.keep is ALL_REGIONS else sorted(cast("frozenset[str]", self.keep))
        parts = [f"keep={keep}"]
        if self.policy is not SAVE_COSTLY:
            parts.append(f"policy={policy_key(self.policy)}")
        if self.budget is not None:
            parts.append(f"budget={self.budget:g}")
        if self.offload:
            parts.append(f"offload={sorted(self.offload)}")
        return ", ".join(parts)

    def refuse_budget_eagerly(self, who: str, fix: str) -> None:
        """Raise where a scope with a budget runs in the eager engine (no partitioner)."""
        if self.budget is not None:
            raise ValueError(
                f"{who}: budget={self.budget:g} runs in the eager engine, which has no partitioner to "
                f"spend a budget (budget= applies to compiled code only). {fix}, or drop budget="
            )


def format_scope(
    keep_text: str, policy: RegionPolicy, budget: float | None, offload: frozenset[str] = frozenset()
) -> str:
    """Scope-marker text: the keep set, then ``;policy=...`` / ``;budget=...`` /
    ``;offload=...`` when not default."""
    parts = [keep_text]
    key = policy_key(policy)
    if key != "save_costly":
        parts.append(f"policy={key}")
    if budget is not None:
        parts.append(f"budget={budget!r}")
    if offload:
        parts.append(f"offload={format_keep(offload)}")
    return ";".join(parts)


def _fields(text: str) -> dict[str, str]:
    """A scope text's ``name=value`` fields after its keep set."""
    return dict(item.partition("=")[::2] for item in text.split(";")[1:])


def keep_of_text(text: str) -> KeepSet:
    """The keep set of scope-marker ``text`` alone (its policy is not looked up)."""
    return parse_keep(text.split(";")[0])


def parse_scope(text: str) -> tuple[str, RegionPolicy, float | None]:
    """Inverse of :func:`format_scope`: (keep text, policy, budget)."""
    fields = _fields(text)
    policy = resolve_policy(fields["policy"]) if "policy" in fields else SAVE_COSTLY
    budget = float(fields["budget"]) if "budget" in fields else None
    return text.split(";")[0], policy, budget
