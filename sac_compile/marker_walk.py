"""The marker walk: which regions and checkpoint scopes are open at each point of a marker
sequence, and which markers do not balance.

One implementation for every reader of markers: the tagging pass over a joint graph's
forward and over an inference graph (:mod:`sac_compile.passes.tag_regions`), and the eager
engine's session as the markers run (:mod:`sac_compile.eager.session`).

Regions are counted (a name opened twice stays open until closed twice). An exit with
nothing open is *unopened*: in a graph the region was open since the graph's start (a graph
break split it); eagerly it is an unbalanced marker. An enter never exited by the end is
*left open*. Scopes nest; an exit closes the innermost open scope with its id.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Callable, Iterable
from typing import TypeVar, cast

__all__ = [
    "ENTER_WITHOUT_EXIT",
    "EXIT_WITHOUT_ENTER",
    "POLICY_SCOPE",
    "MarkerKind",
    "OpenRegions",
    "balance",
    "close_innermost",
]

EXIT_WITHOUT_ENTER = "exit without enter"
ENTER_WITHOUT_EXIT = "enter without exit"
#: a scope marker's id when the layer inside is checkpointed by PyTorch's selective checkpointing
#: (Note [a seam inside a checkpoint compiled without the pass] in sac_compile/policy_checkpoint.py;
#: 0: a wrapped layer's scope, 1: a layer compiled on its own, sac_compile.markers.regions)
POLICY_SCOPE = 2


class MarkerKind(str, enum.Enum):
    """The four markers (equal to their op names' last component, as strings)."""

    REGION_ENTER = "region_enter"
    REGION_EXIT = "region_exit"
    SCOPE_ENTER = "scope_enter"
    SCOPE_EXIT = "scope_exit"

    @property
    def is_scope(self) -> bool:
        return self in (MarkerKind.SCOPE_ENTER, MarkerKind.SCOPE_EXIT)

    def __str__(self) -> str:
        return self.value


class OpenRegions:
    """The regions open at the current point of a marker sequence, entries counted.

    ``initial``: regions open before the sequence starts (a graph that starts inside them).
    """

    def __init__(self, initial: Iterable[str] = ()) -> None:
        self.count: Counter[str] = Counter(initial)
        self.unopened: Counter[str] = Counter()  # exits with nothing open
        self.unbalanced: list[tuple[str, str]] = []  # each exit without enter, in order
        self._entered: Counter[str] = Counter()  # entered in the sequence, not yet exited
        self._names: tuple[str, ...] | None = None

    def enter(self, name: str) -> None:
        self.count[name] += 1
        self._entered[name] += 1
        self._names = None

    def exit(self, name: str) -> bool:
        """Close ``name``; False (and recorded) when it was not open."""
        if self.count[name] > 0:
            self.count[name] -= 1
            if self._entered[name] > 0:
                self._entered[name] -= 1
            self._names = None
            return True
        self.unopened[name] += 1
        self.unbalanced.append((name, EXIT_WITHOUT_ENTER))
        return False

    def names(self) -> tuple[str, ...]:
        """The open regions, sorted (cached until the next marker)."""
        if self._names is None:
            self._names = tuple(sorted(n for n, c in self.count.items() if c > 0))
        return self._names

    def left_open(self) -> list[tuple[str, str]]:
        """Each enter of the sequence never exited, in first-entered order."""
        return [(name, ENTER_WITHOUT_EXIT) for name, c in self._entered.items() for _ in range(c)]

    def known(self) -> list[str]:
        """Every region the walk has seen open or entered."""
        return list(self.count)


_T = TypeVar("_T")


def close_innermost(stack: list[_T], is_it: Callable[[_T], bool]) -> bool:
    """Remove the innermost entry of ``stack`` that ``is_it``; False when there is none."""
    for i in range(len(stack) - 1, -1, -1):
        if is_it(stack[i]):
            del stack[i]
            return True
    return False


def balance(
    markers: Iterable[tuple[MarkerKind, tuple]],
    regions: Iterable[str] = (),
    scopes: Iterable[int] = (),
) -> tuple[Counter[str], list[tuple[int, str]], list[tuple[str, str]]]:
    """Walk ``(kind, args)`` markers in program order, starting inside ``regions`` and the
    scopes ``scopes`` (ids). Returns the regions and the scopes ``(id, text)`` open since
    before the start that nothing said were (their exit came unopened), and the unbalanced
    markers: each exit without an enter, in order, then each enter without an exit."""
    walk = OpenRegions(regions)
    open_scopes = list(scopes)
    pre_scopes: list[tuple[int, str]] = []
    for kind, args in markers:
        if kind is MarkerKind.REGION_ENTER:
            walk.enter(str(args[0]))
        elif kind is MarkerKind.REGION_EXIT:
            walk.exit(str(args[0]))
        elif kind is MarkerKind.SCOPE_ENTER:
            open_scopes.append(int(args[0]))
        elif not close_innermost(
            open_scopes, cast("Callable[[int], bool]", lambda sid, args=args: sid == int(args[0]))
        ):
            pre_scopes.insert(0, (int(args[0]), str(args[1])))
    return walk.unopened, pre_scopes, walk.unbalanced + walk.left_open()
