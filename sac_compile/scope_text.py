"""A checkpoint scope's keep set, region policy and budget as the text its scope markers
carry (``format_scope`` / ``parse_scope``), and the budget's validation."""

from __future__ import annotations

from .policy import RegionPolicy, policy_key, resolve_policy, save_costly

__all__ = ["format_scope", "parse_scope", "validate_budget"]


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


def format_scope(keep_text: str, policy: RegionPolicy, budget: float | None) -> str:
    """Scope-marker text: the keep set, then ``;policy=...`` / ``;budget=...`` when not default."""
    parts = [keep_text]
    key = policy_key(policy)
    if key != "save_costly":
        parts.append(f"policy={key}")
    if budget is not None:
        parts.append(f"budget={budget!r}")
    return ";".join(parts)


def parse_scope(text: str) -> tuple[str, RegionPolicy, float | None]:
    """Inverse of :func:`format_scope`: (keep text, policy, budget)."""
    keep_text, *extra = text.split(";")
    policy: RegionPolicy = save_costly
    budget = None
    for item in extra:
        name, _, value = item.partition("=")
        if name == "policy":
            policy = resolve_policy(value)
        elif name == "budget":
            budget = float(value)
    return keep_text, policy, budget
