"""Region names and keep sets: validation shared by every public entry point.

A *keep set* says which marked regions are saved. It is always explicit: a
collection of region names, or :data:`ALL_REGIONS` for "every marked region".
``None`` is rejected on purpose: "keep nothing" and "keep everything" are both
plausible readings of it, and the difference is the whole point of the library.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final, cast

__all__ = [
    "ALL_REGIONS",
    "INPUT",
    "NO_REGION",
    "PARAM",
    "RNG",
    "Keep",
    "KeepSet",
    "Regions",
    "normalize_keep",
    "validate_region_name",
]

# Characters a region name may not hold: "," separates names in keep texts (scope
# markers, cache keys), ";" separates a scope marker's fields (";policy=", ";budget="),
# "+" joins the regions open at once in reports ("attn+mlp"), and whitespace controls
# break the report tables.
_FORBIDDEN = (",", ";", "+", "\n", "\r", "\t")

# Keys that reports use next to region names, for values no region owns: the partition
# report (inspection.report) and the eager engine's held bytes (eager.state). A region
# of that name would be merged with them, so these words are reserved.
NO_REGION = "-"  # computed outside every region
INPUT = "input"  # a graph input (an activation entering the scope)
PARAM = "param"  # a parameter or buffer
RNG = "rng"  # RNG state saved to replay random ops
_RESERVED = (NO_REGION, INPUT, PARAM, RNG)


class _AllRegions:
    """Sentinel type of :data:`ALL_REGIONS` (a singleton that survives pickling)."""

    _instance: _AllRegions | None = None

    def __new__(cls) -> _AllRegions:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "sac_compile.ALL_REGIONS"

    def __reduce__(self) -> str:
        return "ALL_REGIONS"

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str)


#: Keep every marked region (what :data:`sac_compile.sac_backend` does).
ALL_REGIONS: Final = _AllRegions()

KeepSet = frozenset[str] | _AllRegions

#: What a ``keep=`` argument takes: region names (any iterable of str: a set, a tuple, ``()``
#: for none) or :data:`ALL_REGIONS`. Normalized to a :data:`KeepSet` by :func:`normalize_keep`.
Keep = Iterable[str] | _AllRegions
#: What an ``offload=`` argument takes: region names (never ``ALL_REGIONS``).
Regions = Iterable[str]


def validate_region_name(name: object, *, what: str = "region name") -> str:
    """Return ``name`` if it is a usable region name, else raise ``TypeError``/``ValueError``."""
    if not isinstance(name, str):
        raise TypeError(
            f"{what} must be a str, got {type(name).__name__} {name!r}; "
            f'pass a non-empty string such as region("attn")'
        )
    if not name or name.strip() != name:
        raise ValueError(
            f"{what} must be a non-empty string without leading or trailing "
            f'whitespace, got {name!r}; use a name such as "attn" or "experts"'
        )
    if name == "*":
        raise ValueError(
            f'{what} "*" is reserved (it spells ALL_REGIONS in scope markers); '
            "choose another name, or pass keep=sac_compile.ALL_REGIONS"
        )
    if name in _RESERVED:
        raise ValueError(
            f"{what} {name!r} is reserved: reports use {', '.join(map(repr, _RESERVED))} for values no "
            f"region owns, so a region of that name would be merged with them; choose another name "
            f"(e.g. {name.strip('-') or 'glue'}_region)"
        )
    bad = [c for c in _FORBIDDEN if c in name]
    if bad:
        raise ValueError(
            f"{what} {name!r} contains {bad[0]!r}; region names may not contain "
            "',' or ';' (they separate names and fields in the scope markers), '+' "
            "(reports join overlapping regions with it: 'attn+mlp'), tabs or newlines; "
            f"use '_' instead, e.g. {name.replace(bad[0], '_')!r}"
        )
    return name


def normalize_keep(keep: object) -> KeepSet:
    """Turn a user's ``keep`` argument into a frozenset of names or :data:`ALL_REGIONS`."""
    if keep is ALL_REGIONS:
        return ALL_REGIONS
    if keep is None:
        raise TypeError(
            "keep=None is ambiguous; pass keep=() to keep nothing (full recompute), "
            "a collection of region names such as keep={'attn'}, or "
            "keep=sac_compile.ALL_REGIONS to keep every marked region"
        )
    if isinstance(keep, (str, bytes)):
        raise TypeError(
            f"keep must be a collection of region names, got the string {keep!r}; "
            f"write keep={{{keep!r}}} to keep that one region"
        )
    if not isinstance(keep, Iterable):
        raise TypeError(
            f"keep must be a collection of region names or sac_compile.ALL_REGIONS, "
            f"got {type(keep).__name__} {keep!r}"
        )
    names = [validate_region_name(n, what="name in keep") for n in keep]
    return frozenset(names)


def format_keep(keep: KeepSet) -> str:
    """Stable text for a keep set (cache keys, reports, scope-marker payloads)."""
    if keep is ALL_REGIONS:
        return "*"
    return ",".join(sorted(cast("frozenset[str]", keep)))


def parse_keep(text: str) -> KeepSet:
    """Inverse of :func:`format_keep`."""
    if text == "*":
        return ALL_REGIONS
    return frozenset(n for n in text.split(",") if n)
