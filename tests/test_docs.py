"""Every ```python block of README.md and docs/*.md compiles, uses only names sac_compile has, and runs.

HTML comments on the lines just before a block (invisible once rendered) steer it:

* ``<!-- not-run: why -->``: the block is compiled and its names checked, not run
  (it needs several processes, long Inductor compiles, a GPU...);
* ``<!-- expect: text -->``: the block's output (stdout and stderr) must contain ``text``.

The runnable blocks run in a helper process (this file run as a script) that imports
torch, sac_compile and the blocks' other imports once -- on a 2-core machine that
import is most of a block's cost -- and then forks a fresh child per block, each
with its own timeout. The README's 20-line example is run by tests/test_readme.py.
"""

from __future__ import annotations

import ast
import gc
import importlib
import json
import os
import re
import runpy
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest

if __package__:
    from .releases import default_torch_only
else:  # this file run as the blocks' helper process (python tests/test_docs.py): no marks needed
    default_torch_only = pytest.mark.skipif(False, reason="")

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
ANY_FENCE = re.compile(r"^[ \t]*```.*?^[ \t]*```[ \t]*$", re.S | re.M)
MARKER = re.compile(r"<!--\s*(not-run|expect):\s*(.*?)\s*-->")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
QUOTED_NAME = re.compile(r"`(sac_compile(?:\.\w+)+)")  # `sac_compile.hf.config_for(...)`
QUOTED_PATH = re.compile(r"`((?:sac_compile|tests|examples|benchmarks|docs)/[\w/.-]+)")
TIMEOUT = 120  # seconds per block
README_MAX_LINES = 200  # issue #13: reference material goes to docs/, not back into the README


@dataclass(frozen=True)
class Snippet:
    page: str  # relative to the repository root
    line: int  # of the opening fence, 1-based
    code: str
    not_run: str | None  # the reason given, or None when the block runs
    expect: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


def _snippets() -> list[Snippet]:
    found = []
    for page in PAGES:
        text = page.read_text()
        lines = text.splitlines()
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            not_run, expect = None, []
            i = line - 2  # the line before the fence, 0-based
            while i >= 0 and (marker := MARKER.fullmatch(lines[i].strip())):
                kind, value = marker.groups()
                if kind == "not-run":
                    not_run = value
                else:
                    expect.append(value)
                i -= 1
            rel = page.relative_to(ROOT).as_posix()
            found.append(Snippet(rel, line, m.group(1), not_run, tuple(reversed(expect))))
    return found


SNIPPETS = _snippets()
RUNNABLE = [s for s in SNIPPETS if s.not_run is None]


def _names(snippets: list[Snippet]) -> list[str]:
    return [s.name for s in snippets]


# --------------------------------------------------------------------------- names


def _is_sac(module: str | None) -> bool:
    return module is not None and module.split(".")[0] == "sac_compile"


def _sac_references(tree: ast.AST) -> set[str]:
    """Dotted names the code takes from sac_compile: imported, or read from an alias
    (``sc.region``, ``sac_compile.hf.config_for``, ``hf.batch`` after ``from sac_compile import hf``)."""
    aliases = {"sc": "sac_compile", "sac_compile": "sac_compile"}
    refs = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if _is_sac(a.name):
                    refs.add(a.name)
                    if a.asname:
                        aliases[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _is_sac(node.module):
            for a in node.names:
                if a.name != "*":
                    refs.add(f"{node.module}.{a.name}")
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain = []
            cur: ast.expr = node
            while isinstance(cur, ast.Attribute):
                chain.append(cur.attr)
                cur = cur.value
            if isinstance(cur, ast.Name) and cur.id in aliases:
                refs.add(".".join([aliases[cur.id], *reversed(chain)]))
    return refs


def _resolve(dotted: str) -> object:
    """The object ``dotted`` names, importing submodules on the way (``sac_compile.hf``)."""
    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=2):
        obj = getattr(obj, part) if hasattr(obj, part) else importlib.import_module(".".join(parts[:i]))
    return obj


def _imported_modules(code: str) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            modules.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.add(node.module)
    return modules


def test_every_python_block_is_found():
    for page in PAGES:
        rel = page.relative_to(ROOT).as_posix()
        fences = [ln for ln in page.read_text().splitlines() if ln.strip().startswith("```py")]
        found = [s for s in SNIPPETS if s.page == rel]
        # an indented fence, ```py or ```python3 would escape every check below
        assert len(fences) == len(found), f"{rel}: write Python blocks as a bare ```python fence"
    assert len(RUNNABLE) >= 5, _names(RUNNABLE)


@pytest.mark.parametrize("snippet", SNIPPETS, ids=_names(SNIPPETS))
def test_block_compiles_and_its_sac_compile_names_exist(snippet):
    compile(snippet.code, snippet.name, "exec")
    missing = []
    for ref in sorted(_sac_references(ast.parse(snippet.code))):
        try:
            _resolve(ref)
        except (ImportError, AttributeError) as e:
            missing.append(f"{ref} ({type(e).__name__}: {e})")
    assert not missing, f"{snippet.name} uses names that sac_compile does not have: {missing}"
    if snippet.not_run is not None:
        assert snippet.not_run, f"{snippet.name}: say why it is not run: <!-- not-run: why -->"
        assert not snippet.expect, f"{snippet.name}: an expect marker on a block that is not run"


# --------------------------------------------------------------------------- runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[object, str]]:
    """Runs every runnable block once; {name: (exit status or "timeout", output)}."""
    work = tmp_path_factory.mktemp("doc_blocks")
    jobs = []
    for i, s in enumerate(RUNNABLE):
        script = work / f"{i:02d}_{re.sub(r'[^A-Za-z0-9]+', '_', s.name)}.py"
        script.write_text(s.code)
        jobs.append({"name": s.name, "script": str(script), "log": str(work / f"{i:02d}.log")})
    preload = sorted({m for s in RUNNABLE for m in _imported_modules(s.code)})
    spec = work / "jobs.json"
    spec.write_text(json.dumps({"preload": preload, "jobs": jobs, "timeout": TIMEOUT}))
    env = {
        **os.environ,
        "TORCHINDUCTOR_COMPILE_THREADS": "1",
        "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor_cache"),  # cold: the tagging pass runs
    }
    done = subprocess.run(
        [sys.executable, __file__, str(spec)],
        cwd=work,  # whatever a block writes lands here
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT * len(jobs) + 300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    status = json.loads((work / "results.json").read_text())
    return {j["name"]: (status.get(j["name"], "not run"), Path(j["log"]).read_text()) for j in jobs}


@default_torch_only
@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("snippet", RUNNABLE, ids=_names(RUNNABLE))
def test_block_runs(snippet, runs):
    status, output = runs[snippet.name]
    assert status == 0, f"{snippet.name} ended with {status}:\n{output[-4000:]}"
    for text in snippet.expect:
        assert text in output, f"{snippet.name}: expected {text!r} in its output:\n{output[-4000:]}"


#: what every block would import lazily (torch.compile's Dynamo, AOTAutograd, Inductor): once in
#: the helper process, not once per forked block (CI time)
PRELOAD = ["torch._dynamo", "torch._functorch.aot_autograd", "torch._inductor.compile_fx"]


def _serve(spec_path: Path) -> None:
    """The helper process: import once, then fork one child per block."""
    spec = json.loads(spec_path.read_text())
    for module in ["torch", "sac_compile", *PRELOAD, *spec["preload"]]:
        try:
            importlib.import_module(module)
        except Exception:
            pass  # the block that imports it reports the error
    try:  # transformers' lazy modules: the model classes the blocks' tiny models are built from
        import transformers

        for name in ("LlamaForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM"):
            getattr(transformers, name)
    except Exception:
        pass
    gc.freeze()  # the imports, out of every block's collections (a forked child inherits it)
    results = {}
    for job in spec["jobs"]:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _run_child(job)
        results[job["name"]] = _wait(pid, spec["timeout"])
    (spec_path.parent / "results.json").write_text(json.dumps(results))


def _run_child(job: dict) -> None:
    os.setsid()  # its own process group: a timeout kills whatever it started
    fd = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    status = 0
    try:
        runpy.run_path(job["script"], run_name="__main__")
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            status = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            status = 1
    except BaseException:
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _wait(pid: int, timeout: float) -> object:
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return f"timeout after {timeout} s"
        time.sleep(0.05)


# --------------------------------------------------------------------------- structure


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _prose(text: str) -> str:
    return ANY_FENCE.sub("", text)


def _anchors(page: Path) -> set[str]:
    return {_slug(h) for h in re.findall(r"^#{1,6} (.*)$", _prose(page.read_text()), re.M)}


def test_relative_links_resolve():
    broken = []
    for page in PAGES:
        for target in LINK.findall(_prose(page.read_text())):
            if re.match(r"[a-z]+:", target):
                continue  # http:, https:, mailto:
            path, _, fragment = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT).as_posix()}: ({target})"
            if not dest.exists():
                broken.append(f"{where}: no such file")
            elif fragment and dest.suffix == ".md" and fragment not in _anchors(dest):
                broken.append(f"{where}: no heading with that anchor")
    assert not broken, "\n".join(broken)


def test_names_and_paths_in_the_prose_exist():
    """`sac_compile.x.y` and `tests/...py`-style paths quoted in the text name real things."""
    missing = []
    for page in PAGES:
        prose = _prose(page.read_text())
        where = page.relative_to(ROOT).as_posix()
        for dotted in sorted(set(QUOTED_NAME.findall(prose))):
            try:
                _resolve(dotted)
            except (ImportError, AttributeError):
                missing.append(f"{where}: {dotted}")
        for path in sorted(set(QUOTED_PATH.findall(prose))):
            if not (ROOT / path).exists():
                missing.append(f"{where}: {path}")
    assert not missing, "\n".join(missing)


def _readme_section(heading: str) -> str:
    text = README.read_text()
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def test_the_readme_api_table_lists_every_export():
    import sac_compile

    table = _readme_section("Public API")
    missing = [n for n in sac_compile.__all__ if not re.search(rf"`{re.escape(n)}\b", table)]
    assert not missing, f"README's Public API table does not mention {missing}"


def test_the_readme_links_every_docs_page_and_stays_short():
    listed = set(LINK.findall(_readme_section("Documentation")))
    pages = {f"docs/{p.name}" for p in PAGES[1:]}
    assert pages <= listed, f"README's Documentation list lacks {sorted(pages - listed)}"
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: move reference material to docs/"


_HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
_ISSUE = re.compile(r"\b[Ii]ssues? #?\d+|(?<![\w`'])#\d{1,4}\b(?![\w-])")


def test_the_docs_state_what_is_true_now_without_commit_hashes_or_issue_numbers():
    """Reference, not a diary: history lives in CHANGELOG.md."""
    found = [
        f"{page.relative_to(ROOT)}:{n}: {m.group(0)}"
        for page in PAGES
        for n, line in enumerate(page.read_text().splitlines(), 1)
        for m in [*_HASH.finditer(line), *_ISSUE.finditer(line)]
    ]
    assert not found, "\n".join(found)


def test_the_history_check_can_fail():
    assert _HASH.search("measured at 605c262 on 2 cores") and not _HASH.search("33554432 bytes, deadbeef")
    assert _ISSUE.search("(issue #17)") and _ISSUE.search("the cost #17 removed")
    assert not _ISSUE.search("`#1 layer split by a graph break`")


if __name__ == "__main__":
    _serve(Path(sys.argv[1]))


_FIXTURE_IMPORT = re.compile(
    r"from sac_compile\.testing(?:\.(\w+))? import ([\w, ]+?)(?:\s+as \w+)?\s*$", re.M
)


def test_the_readme_docs_and_examples_import_only_public_fixtures():
    """What the README, the docs and the examples import from ``sac_compile.testing`` is in
    ``testing.PUBLIC`` (red before: no such list; ``parity``, a test fixture, was in the README)."""
    from sac_compile.testing import PUBLIC

    sources = [README, *PAGES, *sorted((ROOT / "examples").rglob("*.py"))]
    used = []
    for path in sources:
        text = path.read_text()
        for module, names in _FIXTURE_IMPORT.findall(text):
            for name in (n.strip() for n in names.split(",")):
                if module:
                    used.append((path.name, module, name))
                else:  # from sac_compile.testing import hf_families: its attributes used
                    attrs = set(re.findall(rf"\b{name}\.(\w+)", text)) - {"py"}
                    used += [(path.name, name, a) for a in attrs] or [(path.name, name, "")]
    assert len(used) >= 10, used
    private = [u for u in used if u[1] not in PUBLIC or (u[2] and u[2] not in PUBLIC[u[1]])]
    assert not private, private
