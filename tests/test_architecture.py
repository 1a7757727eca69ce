"""The package's structure, checked: imports point down the layers, no cycles, every private
PyTorch API behind ``sac_compile._compat``, ``import sac_compile`` stays light, modules stay small.

Each check fails on a concrete violation (it names the module and the line); they read the
source with ``ast`` / ``tokenize``, so they cost a fraction of a second.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "sac_compile"

# Lower layers first; a module may import only from its own layer or below (and never
# from its own layer in a cycle). ``testing`` (fixtures) sits on top of everything.
LAYERS: list[tuple[str, ...]] = [
    ("_compat",),
    (
        "keep",
        "memory",
        "records",
        "op_classes",
        "policy",
        "actions",
        "arguments",
        "marker_walk",
    ),
    ("diagnostics",),
    ("markers",),
    ("declare", "passes"),
    ("compiler", "eager"),
    ("seam", "config", "context_fn", "compiled_forward", "policy_checkpoint", "pipelining"),
    ("inspection",),
    ("planning",),
    ("hf",),
    ("__init__", "__main__", "plan_report"),
    ("testing",),
]


def _layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else "__init__"
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"{module} is in no layer of tests/test_architecture.py: add it")


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1] if len(parts) > 1 else parts
        found[".".join(parts) if parts != ["sac_compile", "__init__"] else "sac_compile"] = path
    return found


def _from_module(node: ast.ImportFrom, package: str) -> str:
    """The absolute module a ``from ... import`` in ``package`` imports from."""
    if not node.level:
        return node.module or ""
    base = package.split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(name: str, path: Path, known: set[str]) -> list[tuple[str, int]]:
    """(imported sac_compile module, line) for every import in the file, lazy ones included."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = _from_module(node, package)
            # `from . import x` may import a submodule x
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t.startswith("sac_compile") and t != name:
                out.append((t, node.lineno))
    return out


def _graph() -> dict[str, list[tuple[str, int]]]:
    mods = _modules()
    known = set(mods)
    return {name: _imports(name, path, known) for name, path in mods.items()}


def test_imports_point_down_the_layers():
    graph = _graph()
    upward = [
        f"{a} (layer {_layer(a)}) imports {b} (layer {_layer(b)}) at line {line}"
        for a, edges in graph.items()
        for b, line in edges
        # a package may import its own modules (the root package is checked like any module)
        if _layer(b) > _layer(a) and not (a != "sac_compile" and b.startswith(a + "."))
    ]
    assert not upward, "\n".join(upward)


def test_the_import_graph_has_no_cycle():
    graph = {
        a: {b for b, _ in edges if a == "sac_compile" or not b.startswith(a + ".")}
        for a, edges in _graph().items()
    }
    # a package's __init__ re-exporting its modules is not a cycle with them
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt) :] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


# Private PyTorch names and conventions that only sac_compile._compat may touch: torch
# attributes and modules whose name starts with "_" (op namespaces such as
# torch.ops._c10d_functional are op names, not APIs), nn.Module / frame / code internals,
# and the string conventions of Dynamo's and AOTAutograd's graphs.
_PRIVATE_NAMES = (
    "_orig_mod",
    "_getframe",
    "f_locals",
    "f_back",
    "co_name",
    "co_filename",
    "co_varnames",
    "_compiled_call_impl",
    "_call_impl",
)
_PRIVATE_STRINGS = (
    "tangents",
    "primals_",
    "_buffers_",
    "rng_state_output",
    "stack_trace",
    "nn_module_stack",
    "partitioner_tag",
)


def _dotted(node: ast.AST) -> list[str]:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return parts[::-1]


def _private_torch_path(parts: list[str]) -> bool:
    if not parts or parts[0] != "torch" or parts[1:2] == ["ops"]:
        return False  # torch.ops.<namespace>.<op>: op names (aten._to_copy), not Python APIs
    return any(p.startswith("_") and not p.endswith("__") for p in parts[1:])


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def _private_uses(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    docs = _docstrings(tree)
    aliases = {"torch"}  # names bound to torch or one of its modules
    found = []

    def hit(node: ast.AST, what: str) -> None:
        found.append(f"{path.name}:{node.lineno}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if _private_torch_path(a.name.split(".")):
                    hit(node, f"import {a.name}")
                if a.name.split(".")[0] == "torch":
                    aliases.add(a.asname or "torch")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            mod = node.module.split(".")
            for a in node.names:
                if _private_torch_path(mod + [a.name]):
                    hit(node, f"from {node.module} import {a.name}")
        elif isinstance(node, ast.Attribute):
            parts = _dotted(node)
            if parts and parts[0] in aliases and _private_torch_path(["torch", *parts[1:]]):
                hit(node, ".".join(parts))
            elif node.attr in _PRIVATE_NAMES:
                hit(node, node.attr)
        elif isinstance(node, ast.Name) and node.id in _PRIVATE_NAMES:
            hit(node, node.id)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            if any(s in node.value for s in _PRIVATE_STRINGS + _PRIVATE_NAMES):
                hit(node, repr(node.value))
    by_line: dict[int, str] = {}
    for f in found:  # one finding per line (a chain's prefixes are found too)
        by_line.setdefault(int(f.split(":")[1]), f)
    return [by_line[k] for k in sorted(by_line)]


def test_private_torch_apis_are_used_only_in_compat():
    found = []
    for path in _outside_compat():
        found += _private_uses(path)
    assert not found, "private PyTorch API outside sac_compile/_compat:\n" + "\n".join(found)


def test_the_private_api_check_can_fail(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        '"""torch._dynamo in a docstring is fine."""\n'
        "import torch\n"
        "import torch as t\n"
        "# torch._inductor in a comment is fine\n"
        "x = torch._dynamo.config\n"
        "y = getattr(m, '_orig_mod', m)\n"
        "z = lambda n: 'tangents' in n\n"
        "from torch import _dynamo\n"
        "w = t.distributed._functional_collectives\n"
        "ok = torch.ops._c10d_functional.wait_tensor\n"
    )
    got = _private_uses(bad)
    assert [g.split(":")[1] for g in got] == ["5", "6", "7", "8", "9"], got


# Underscored attributes that are public API despite the underscore (namedtuple's).
_PUBLIC_UNDERSCORED = frozenset({"_asdict", "_replace", "_fields", "_make"})


def _defined_names(paths: list[Path]) -> set[str]:
    """Every name sac_compile itself defines, binds or assigns as an attribute."""
    found: set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                found.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                found.add(node.attr)
            elif isinstance(node, ast.alias):
                found.add(node.asname or node.name.split(".")[-1])
            elif isinstance(node, ast.arg):
                found.add(node.arg)
    return found


def _foreign_private_attributes(path: Path, ours: set[str]) -> list[str]:
    """``x._name`` reads of an underscored attribute no sac_compile code defines: another
    package's private attribute (``._schema``, ``._cdata``, ``._version``, ``._from_config``).
    Operator names are not attributes of an API: ``torch.ops.<ns>.<op>`` and ``aten._to_copy``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.endswith("__"):
            continue
        if node.attr in ours or node.attr in _PUBLIC_UNDERSCORED:
            continue
        parts = _dotted(node.value)
        if "ops" in parts or parts[:1] == ["aten"]:
            continue
        found.append((node.lineno, f"{path.name}:{node.lineno}: .{node.attr}"))
    return [f for _, f in sorted(found)]


def _outside_compat() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py")) if "_compat" not in p.parts]


def test_private_attributes_of_other_packages_are_read_only_in_compat():
    paths = _outside_compat()
    ours = _defined_names(paths)
    found = [f for p in paths for f in _foreign_private_attributes(p, ours)]
    assert not found, "another package's private attribute outside sac_compile/_compat:\n" + "\n".join(found)


def test_the_private_attribute_check_can_fail(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "def f(op, t, s, cls, cfg, point):\n"
        "    a = op._schema.name\n"
        "    b = t._version\n"
        "    c = s._cdata\n"
        "    m = cls._from_config(cfg)\n"
        "    ok = torch.ops.aten._to_copy.default, point._replace(x=1), aten._to_copy\n"
        "    self._mine = 1\n"
        "    return self._mine\n"
    )
    got = _foreign_private_attributes(bad, _defined_names([bad]))
    assert [g.split(": ")[1] for g in got] == ["._schema", "._version", "._cdata", "._from_config"], got


def _private_names_across_modules(
    name: str, path: Path, known: set[str], root: Path = PACKAGE.parent
) -> list[str]:
    """``from <another sac_compile module> import _x`` and ``<module alias>._x`` in one file."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    modules: set[str] = set()  # local names bound to sac_compile modules
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            mod = _from_module(node, package)
            if not mod.startswith("sac_compile") or mod == name:
                continue
            for a in node.names:
                if f"{mod}.{a.name}" in known:
                    if f"{mod}.{a.name}" != name:
                        modules.add(a.asname or a.name)
                elif a.name.startswith("_") and not a.name.startswith("__"):
                    found.append(f"{path.relative_to(root)}:{node.lineno}: {a.name} from {mod}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("sac_compile") and a.asname:
                    modules.add(a.asname)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            found.append(f"{path.relative_to(root)}:{node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_modules_use_only_each_others_public_names():
    mods = _modules()
    known = set(mods)
    found = [f for name, path in mods.items() for f in _private_names_across_modules(name, path, known)]
    assert not found, (
        "a private name used from another sac_compile module (make it public there):\n" + "\n".join(found)
    )


def test_the_cross_module_check_can_fail(tmp_path):
    pkg = tmp_path / "sac_compile" / "eager"
    pkg.mkdir(parents=True)
    bad = pkg / "bad.py"
    bad.write_text(
        "from .op_facts import _storage, storage_of\n"
        "from ..markers import ops\n"
        "from . import bad\n"
        "ops._MARKER_SINK = None\n"
        "x = bad._own, storage_of.__name__\n"
    )
    known = {"sac_compile.eager.op_facts", "sac_compile.markers.ops", "sac_compile.eager.bad"}
    got = _private_names_across_modules("sac_compile.eager.bad", bad, known, root=tmp_path)
    assert [g.split(": ")[1] for g in got] == [
        "_storage from sac_compile.eager.op_facts",
        "ops._MARKER_SINK",
    ], got


def test_no_module_is_past_450_lines():
    long = [
        f"{p.relative_to(PACKAGE)}: {n} lines"
        for p in sorted(PACKAGE.rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > 450
    ]
    assert not long, long


_PROBE = """
import json, sys, time
import torch
before = set(sys.modules)
t = time.perf_counter()
import sac_compile
dt = time.perf_counter() - t
new = sorted(set(sys.modules) - before)
print(json.dumps({"seconds": dt, "new": new}))
"""


@pytest.mark.subprocess
def test_import_sac_compile_loads_no_compiler_and_no_fixtures():
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    heavy = [
        m
        for m in got["new"]
        if m.startswith(("torch._dynamo", "torch._inductor", "torch._functorch.partitioners", "functorch"))
        or m.startswith("sac_compile.testing")
        or m.startswith("sac_compile.passes.")
    ]
    assert not heavy, heavy
    # sac_compile's own modules plus the few torch modules they need (measured: 63 on torch 2.13)
    assert len(got["new"]) <= 66, (len(got["new"]), got["new"])


def test_the_top_level_holds_at_most_16_names_each_documented():
    """What training code types; everything else lives in a submodule, and a name that left
    the top level says where it went."""
    import sac_compile as sc

    assert len(sc.__all__) <= 16, sc.__all__  # (each documented: tests/test_docs.py)


def test_no_function_is_past_80_lines():
    long = [
        f"{p.relative_to(PACKAGE)}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines"
        for p in sorted(PACKAGE.rglob("*.py"))
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80
    ]
    assert not long, long


_ENTRY = re.compile(r"`(\w+)(/?)`(?:\s*\(((?:`\w+`(?:,\s*)?)+)\))?")


def _layer_table() -> dict[int, dict[str, set[str] | None]]:
    """docs/architecture.md's layer table: per layer, each module listed and, for a package,
    the submodules it lists."""
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    rows: dict[int, dict[str, set[str] | None]] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].isdigit():
            continue
        rows[int(cells[0])] = {
            m.group(1): set(re.findall(r"`(\w+)`", m.group(3) or "")) if m.group(2) else None
            for m in _ENTRY.finditer(cells[1])
        }
    return rows


def test_the_docs_layer_table_is_the_one_this_test_checks():
    """docs/architecture.md's table lists LAYERS in order, each package with every module it
    has (red before: the table put ``hf`` below ``planning`` and left out modules)."""
    rows = _layer_table()
    assert sorted(rows) == list(range(len(LAYERS))), sorted(rows)
    for i, names in enumerate(LAYERS):
        assert set(rows[i]) == set(names), (i, sorted(rows[i]), names)
        for name, listed in rows[i].items():
            if listed is None:
                assert (PACKAGE / f"{name}.py").exists() or name == "__init__", name
                continue
            have = {p.stem for p in (PACKAGE / name).glob("*.py") if p.stem != "__init__"}
            assert listed == have, (name, sorted(have - listed), sorted(listed - have))


def test_public_parameters_are_typed_for_a_reader():
    """``keep``, ``offload``, ``policy``, ``compile`` and ``memory`` on the public entry points
    carry their types (``Keep``, ``Regions``, ``RegionPolicy``, ``Compile``, bytes / a
    fraction / a unit string), not ``object`` or ``Any`` (red before)."""
    import dataclasses
    import inspect

    import sac_compile as sc
    from sac_compile import hf
    from sac_compile.hf.plan import StepFigures

    entry = [
        sc.apply_selective_checkpointing,
        sc.region_context_fn,
        sc.make_sac_backend,
        sc.plan,
        hf.config_for,
        hf.checkpointing_kwargs,
        hf.plan_for,
        StepFigures.peak,
        StepFigures.step,
    ]
    named = {"keep", "offload", "policy", "compile", "memory"}
    found = []
    for f in entry:
        for name, p in inspect.signature(f).parameters.items():
            if name in named:
                found.append((f.__qualname__, name, str(p.annotation)))
    found += [("SacConfig", f.name, str(f.type)) for f in dataclasses.fields(sc.SacConfig) if f.name in named]
    assert len(found) >= 20, found
    untyped = [f for f in found if f[2] in ("object", "Any", "typing.Any", inspect.Parameter.empty)]
    assert not untyped, untyped


# Packages whose ``__all__`` is the public API (README, docs/api.md).
PUBLIC_PACKAGES = (
    "sac_compile",
    "sac_compile.hf",
    "sac_compile.planning",
    "sac_compile.inspection",
    "sac_compile.eager",
    "sac_compile.diagnostics",
)


def _public_objects() -> dict[str, object]:
    """``package.name`` -> object for every name in a public package's ``__all__``."""
    import importlib

    found = {}
    for package in PUBLIC_PACKAGES:
        mod = importlib.import_module(package)
        for name in mod.__all__:
            found[f"{package}.{name}"] = getattr(mod, name)
    return found


def _public_modules() -> set[str]:
    """The modules that define a public name, the public packages themselves and ``_compat``
    (the typed face of the private PyTorch API they call)."""
    import inspect

    found = set(PUBLIC_PACKAGES) | {m for m in _modules() if m.startswith("sac_compile._compat")}
    for obj in _public_objects().values():
        module = obj.__name__ if inspect.ismodule(obj) else getattr(obj, "__module__", None)
        if module is not None and module.startswith("sac_compile"):
            found.add(module)
    return found


def test_the_public_modules_are_checked_as_mypy_strict_checks_them(monkeypatch):
    """``make lint``'s mypy run, configured by pyproject.toml, applies to every public module
    each per-module flag ``mypy --strict`` sets (read from mypy itself, not listed here); red
    before the strict override, and for a public module left out of it."""
    main = pytest.importorskip("mypy.main")
    empty = ["--config-file=", "-c", "pass"]
    _, strict = main.process_options([*empty[:1], "--strict", *empty[1:]])
    _, plain = main.process_options(empty)
    flags = [
        n
        for n in dir(strict)
        if not n.startswith("_")
        and not callable(getattr(strict, n))
        and getattr(strict, n) != getattr(plain, n)
    ]
    assert "disallow_untyped_calls" in flags and "disallow_any_generics" in flags, flags
    monkeypatch.chdir(PACKAGE.parent)
    _, ours = main.process_options(["--config-file", str(PACKAGE.parent / "pyproject.toml")])
    assert ours.warn_redundant_casts  # the one global flag of --strict
    modules = _public_modules()
    assert {"sac_compile.seam", "sac_compile.hf.plan", "sac_compile._compat.aot"} <= modules
    loose = {
        m: [
            f
            for f in flags
            if f != "warn_redundant_casts" and getattr(ours.clone_for_module(m), f) != getattr(strict, f)
        ]
        for m in sorted(modules)
    }
    assert not {m: f for m, f in loose.items() if f}, "add these modules to pyproject.toml's strict override"


# Public parameters typed ``Any`` / ``object`` because any value is right there: what a user's
# function returned, a module or a function (markers), any object a diagnostic is about.
ANYTHING = {
    ("sac_compile.inspection.PartitionReport.__init__", "output"),
    ("sac_compile.eager.EagerSession.enter_module", "module"),
    ("sac_compile.eager.EagerSession.module_output", "module"),
    ("sac_compile.eager.EagerSession.module_output", "output"),
    ("sac_compile.eager.EagerSession.exit_module", "module"),
    ("sac_compile.eager.EagerSession.exit_module", "output"),
    ("sac_compile.diagnostics.report", "owner_"),
    ("sac_compile.diagnostics.reported", "owner_"),
}


def test_no_public_parameter_is_any_where_it_has_a_real_type():
    """Every parameter of a public function or method (``*args`` / ``**kwargs`` aside) names a
    type, not ``Any`` or ``object``, except those in ``ANYTHING`` (red before: ``target``,
    ``backend``, ``device``, ``compile``, ``progress``, the engine's ``keep`` / ``policy``)."""
    import inspect

    def params(qual: str, fn: object) -> list[tuple[str, str, object]]:
        try:
            sig = inspect.signature(fn)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return []
        return [
            (qual, n, p.annotation)
            for n, p in sig.parameters.items()
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and n not in ("self", "cls")
        ]

    found = []
    seen = set()
    for qual, obj in _public_objects().items():
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if inspect.isclass(obj):
            for name, member in vars(obj).items():
                if name.startswith("_") and name != "__init__":
                    continue
                fn = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
                if inspect.isfunction(fn):
                    found += params(f"{qual}.{name}", fn)
        elif inspect.isfunction(obj):
            found += params(qual, obj)
    assert len(found) > 150, len(found)
    loose = [(q, n) for q, n, a in found if str(a) in ("Any", "object", "Any | None", "object | None")]
    assert sorted(set(loose) - ANYTHING) == [], "type these parameters"
    assert ANYTHING <= set(loose), "a parameter in ANYTHING is typed now: take it out"


def _planning_literals(root) -> set[float]:
    """Every number written in the device planner's code (``sac_compile/planning``)."""
    import ast

    found: set[float] = set()
    for path in (root / "planning").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and type(node.value) in (int, float):
                found.add(float(node.value))
    return found


def test_the_planners_world_is_data_not_code():
    """No figure of the world the planner prices a step in is written in its code: the fitted
    step-time figures (each naming the calibrating run it was solved from), the kernel rates
    and every device's datasheet rates are read from ``planning/world.json``; the code's
    constants are the model's own (red before: the efficiencies, the eager slowdown, the
    attention rate and the datasheets sat in ``planning/catalog.py``)."""
    import json

    from sac_compile.planning import catalog

    world = json.loads((PACKAGE / "planning" / "world.json").read_text())
    figures = {f["value"] for f in world["fitted"].values()} | {k["flops"] for k in world["kernels"].values()}
    figures |= {link["bandwidth"] for link in world["host_links"]} | {
        e["value"] for e in world["links"].values()
    }
    for d in world["devices"]:
        figures |= {d["bf16_flops"], d["bandwidth"], d["memory_gib"]} | ({d["link"]} if d["link"] else set())
    written = _planning_literals(PACKAGE) & figures
    assert not written, f"planning/ writes the world's figures {sorted(written)}: read them from world.json"
    assert all(f["calibrating_run"] and f["source"] for f in world["fitted"].values()), world["fitted"]
    assert catalog.DEVICES["a100-80gb"].efficiency == world["fitted"]["a100"]["value"]
    assert catalog.EAGER_SLOWDOWN == world["fitted"]["eager_slowdown"]["value"]
