"""What a checkpoint scope does with its regions' values -- :class:`Actions`: the keep set,
the region policy and the partitioner's budget, one frozen value from every entry point to
the compiled pass, the eager engine and the planner -- and the text its scope markers carry
(``Actions.text`` / ``Actions.from_text``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .keep import KeepSet, format_keep, normalize_keep, parse_keep
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
    saved), the policy deciding a kept region's ops (``policy``), and the fraction of the
    scope's activation bytes PyTorch's knapsack may save beyond them (``budget``, compiled
    code only). Everything else is recomputed.

    Made once at each entry point (:meth:`of` validates the user's arguments) and handed
    on whole: the seam, the backend, the joint-graph pass, the eager engine and the planner
    read these fields and no copies of them. Equal actions compare equal (a policy by
    identity) and hash alike; ``text`` is the scope markers' payload (computed once here: a
    user policy's key hashes its source, which Dynamo cannot trace)."""

    keep: KeepSet = frozenset()
    policy: RegionPolicy = SAVE_COSTLY
    budget: float | None = None
    text: str = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "text", format_scope(format_keep(self.keep), self.policy, self.budget))

    @classmethod
    def of(cls, keep: object = (), policy: object = SAVE_COSTLY, budget: object = None) -> Actions:
        """The actions a user's ``keep`` / ``policy`` / ``budget`` arguments ask for, each
        checked (a clear ``TypeError`` / ``ValueError`` naming the value and the fix)."""
        return cls(normalize_keep(keep), validate_policy(policy), validate_budget(budget))

    @staticmethod
    def from_text(text: str) -> Actions:
        """The actions a scope marker's ``text`` carries (inverse of ``.text``)."""
        keep_text, policy, budget = parse_scope(text)
        return Actions(parse_keep(keep_text), policy, validate_budget(budget))

    def without_budget(self) -> Actions:
        return Actions(self.keep, self.policy)

    def refuse_budget_eagerly(self, who: str, fix: str) -> None:
        """Raise where a scope with a budget runs in the eager engine (no partitioner)."""
        if self.budget is not None:
            raise ValueError(
                f"{who}: budget={self.budget:g} runs in the eager engine, which has no partitioner to "
                f"spend a budget (budget= applies to compiled code only). {fix}, or drop budget="
            )


def format_scope(keep_text: str, policy: RegionPolicy, budget: float | None) -> str:
    """Scope-marker text: the keep set, then ``;policy=...`` / ``;budget=...`` when not default."""
    parts = [keep_text]
    key = policy_key(policy)
    if key != "save_costly":
        parts.append(f"policy={key}")
    if budget is not None:
        parts.append(f"budget={budget!r}")
    return ";".join(parts)


def keep_of_text(text: str) -> KeepSet:
    """The keep set of scope-marker ``text`` alone (its policy is not looked up)."""
    return parse_keep(text.split(";")[0])


def parse_scope(text: str) -> tuple[str, RegionPolicy, float | None]:
    """Inverse of :func:`format_scope`: (keep text, policy, budget)."""
    keep_text, *extra = text.split(";")
    policy: RegionPolicy = SAVE_COSTLY
    budget = None
    for item in extra:
        name, _, value = item.partition("=")
        if name == "policy":
            policy = resolve_policy(value)
        elif name == "budget":
            budget = float(value)
    return keep_text, policy, budget
