"""The marker walk shared by the tagging pass and the eager engine (sac_compile/marker_walk.py)."""

import ast
from pathlib import Path

from sac_compile.marker_walk import ENTER_WITHOUT_EXIT, EXIT_WITHOUT_ENTER, MarkerKind, OpenRegions, balance

E, X, SE, SX = MarkerKind.REGION_ENTER, MarkerKind.REGION_EXIT, MarkerKind.SCOPE_ENTER, MarkerKind.SCOPE_EXIT


def test_regions_are_counted_and_unopened_exits_recorded():
    walk = OpenRegions(["a"])  # a graph that starts inside "a"
    walk.enter("b")
    walk.enter("b")
    assert walk.names() == ("a", "b")
    assert walk.exit("b") and walk.names() == ("a", "b")  # entered twice: still open
    assert walk.exit("b") and walk.names() == ("a",)
    assert walk.exit("a") and not walk.exit("a")  # the second closes nothing
    assert walk.unopened == {"a": 1} and walk.unbalanced == [("a", EXIT_WITHOUT_ENTER)]
    walk.enter("c")
    assert walk.left_open() == [("c", ENTER_WITHOUT_EXIT)]


def test_balance_finds_what_was_open_before_the_start_and_what_never_closed():
    markers = [(X, ("r",)), (SE, (3, "k")), (E, ("s",)), (SX, (3, "k")), (SX, (1, "attn")), (E, ("t",))]
    pre_regions, pre_scopes, unbalanced = balance(markers, regions=(), scopes=(2,))
    assert pre_regions == {"r": 1}
    assert pre_scopes == [(1, "attn")]  # scope 2 is the context's, scope 3 closed in the graph
    assert unbalanced == [("r", EXIT_WITHOUT_ENTER), ("s", ENTER_WITHOUT_EXIT), ("t", ENTER_WITHOUT_EXIT)]


def test_marker_kinds_compare_as_their_op_names():
    assert MarkerKind.REGION_ENTER == "region_enter" and MarkerKind("scope_exit").is_scope
    assert not MarkerKind.REGION_EXIT.is_scope


def test_one_walk_balances_markers():
    """The balance rules live in one module: no other module spells out an unbalanced marker
    (the pass, its inference branch and the eager session all use the walk)."""
    package = Path(__file__).resolve().parents[1] / "sac_compile"
    spelled = [
        f"{p.name}:{node.lineno}"
        for p in package.rglob("*.py")
        if p.name != "marker_walk.py"
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.Constant) and node.value in (EXIT_WITHOUT_ENTER, ENTER_WITHOUT_EXIT)
    ]
    assert not spelled, spelled
