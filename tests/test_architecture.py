"""The package's structure, checked: imports point down the layers, no cycles, every private
PyTorch API behind ``sac_compile._compat``, ``import sac_compile`` stays light, modules stay small.

Each check fails on a concrete violation (it names the module and the line); they read the
source with ``ast`` / ``tokenize``, so they cost a fraction of a second.
"""

from __future__ import annotations

import ast
import io
import json
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "sac_compile"

# Lower layers first; a module may import only from its own layer or below (and never
# from its own layer in a cycle). ``testing`` (fixtures) sits on top of everything.
LAYERS: list[tuple[str, ...]] = [
    ("_compat",),
    ("keep", "records", "policy"),
    ("diagnostics",),
    ("markers",),
    ("declare", "passes"),
    ("compiler", "eager"),
    ("seam", "config"),
    ("hf", "inspection"),
    ("__init__",),
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


def _imports(name: str, path: Path, known: set[str]) -> list[tuple[str, int]]:
    """(imported sac_compile module, line) for every import in the file, lazy ones included."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
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
        if _layer(b) > _layer(a) and not b.startswith(a + ".")  # a package may import its modules
    ]
    assert not upward, "\n".join(upward)


def test_the_import_graph_has_no_cycle():
    graph = {a: {b for b, _ in edges if not b.startswith(a + ".")} for a, edges in _graph().items()}
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


# Private PyTorch names and conventions that only sac_compile._compat may touch.
_PRIVATE_NAMES = ("_orig_mod", "_getframe", "f_locals", "co_name", "co_filename", "_compiled_call_impl")
_PRIVATE_STRINGS = ("tangents", "primals_", "_buffers_", "rng_state_output", "stack_trace")


def _code_tokens(path: Path):
    """(token type, text, line) of the file's code: comments and docstrings are not code, but
    string literals used as values are (``"tangents"`` in a comparison is a convention)."""
    tokens = list(tokenize.generate_tokens(io.StringIO(path.read_text()).readline))
    for i, tok in enumerate(tokens):
        if tok.type == tokenize.COMMENT:
            continue
        if tok.type == tokenize.STRING:
            prev = next(
                (t for t in reversed(tokens[:i]) if t.type not in (tokenize.NL, tokenize.NEWLINE)), None
            )
            if prev is None or prev.type in (tokenize.INDENT, tokenize.DEDENT) or prev.string == ":":
                continue  # a docstring
        yield tok.type, tok.string, tok.start[0]


def _private_uses(path: Path) -> list[str]:
    found = []
    tokens = list(_code_tokens(path))
    for i, (kind, text, line) in enumerate(tokens):
        if kind == tokenize.NAME and text == "torch":
            rest = "".join(t for _, t, _ in tokens[i + 1 : i + 3])
            if rest.startswith("._"):
                found.append(f"{path.name}:{line}: torch{rest}")
        elif kind == tokenize.NAME and text in _PRIVATE_NAMES:
            found.append(f"{path.name}:{line}: {text}")
        elif kind == tokenize.STRING and any(s in text for s in _PRIVATE_STRINGS + _PRIVATE_NAMES):
            found.append(f"{path.name}:{line}: {text}")
    return found


def test_private_torch_apis_are_used_only_in_compat():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "_compat" in path.parts:
            continue
        found += _private_uses(path)
    assert not found, "private PyTorch API outside sac_compile/_compat:\n" + "\n".join(found)


def test_the_private_api_check_can_fail(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        '"""torch._dynamo in a docstring is fine."""\n'
        "import torch\n"
        "# torch._inductor in a comment is fine\n"
        "x = torch._dynamo.config\n"
        "y = getattr(m, '_orig_mod', m)\n"
        "z = name.startswith('tangents')\n"
    )
    got = _private_uses(bad)
    assert [g.split(":")[1] for g in got] == ["4", "5", "6"], got


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
    # sac_compile's own modules plus the few torch modules they need (measured: 35 on torch 2.13)
    assert len(got["new"]) <= 60, (len(got["new"]), got["new"])
