"""The examples of README.md and docs/*.md run, so no page can go stale.

The convention (docs/README.md says the same for writers):
- Every ```python block runs. The blocks of one page run in order in one namespace, like the
  cells of a notebook.
- Every ```pycon block (`>>>` lines and their expected output) runs through the standard
  library's doctest in that same namespace, outputs compared (ELLIPSIS on). Use these for
  deterministic examples: the radix cache, configs, a program's graph, prefix reports.
- A ```bash block does not run, unless the line before it is `<!-- docs-test: run -->`.
- A block that cannot run here (a GPU, a multi-node Ray cluster) has the line
  `<!-- docs-test: not run: <reason> -->` before it, so the reason is in the page's source.
- Other blocks are ```text or ```json and never run; an unlabelled fence is an error.

Examples are written for the real default model and a real server, as a user types them. Before
a page runs, exactly two literals in its blocks are rewritten: the default model's name
`smollm2-135m-instruct` becomes a tiny random-weight model with SmolLM2's tokenizer
(conftest's `tiny_model_dir`), and `http://127.0.0.1:30000` becomes the URL of a live test
server on that model (conftest's `served`). The process-wide default backend is a LocalBackend
on that server's engine, so `program.run(...)` works as written. Random weights say nonsense,
so blocks assert structure (types, counts), never generated text. Engines in examples size
their pool (`max_kv_tokens=`) so this stays small.

A failure names the page and the line of the block. Every page must be linked from README.md,
and every relative link must point at a file that exists.
"""

from __future__ import annotations

import doctest
import os
import re
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest

import flowlang as fl

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_URL = "http://127.0.0.1:30000"
KINDS = ("python", "pycon", "bash", "text", "json")
MARKER = re.compile(r"<!-- docs-test: (run|not run: \S.*?) -->")
FENCE = re.compile(r"^```(.*)$")
LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
BASH_TIMEOUT_S = 60


@dataclass(frozen=True)
class Block:
    kind: str  # the fence's language
    code: str
    line: int  # of the first line inside the fence, 1-based
    marker: str | None  # "run", "not run: <reason>", or None

    @property
    def reason_not_run(self) -> str | None:
        if self.marker is None or not self.marker.startswith("not run"):
            return None
        return self.marker.partition(":")[2].strip()


def rel(page: Path) -> str:
    return str(page.relative_to(ROOT))


def parse_blocks(page: Path) -> list[Block]:
    """The fenced blocks of a page, with the docs-test marker on the line before each; a
    malformed marker or fence fails, naming the line."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    pending: tuple[str, int] | None = None  # a marker waiting for its block
    i = 0
    while i < len(lines):
        line = lines[i]
        where = f"{rel(page)}:{i + 1}"
        opened = FENCE.match(line)
        if line.startswith("<!--") and "docs-test" in line:
            marker = MARKER.fullmatch(line.strip())
            assert marker, (
                f"{where}: write `<!-- docs-test: run -->` or `<!-- docs-test: not run: WHY -->`"
            )
            assert pending is None, f"{where}: two docs-test markers in a row"
            pending = (marker.group(1), i + 1)
        elif opened:
            kind = opened.group(1).strip()
            assert kind in KINDS, f"{where}: label the block as one of {KINDS}, not {kind!r}"
            end = next((j for j in range(i + 1, len(lines)) if lines[j] == "```"), None)
            assert end is not None, f"{where}: the block is never closed"
            text = pending[0] if pending else None
            if text == "run":
                assert kind == "bash", f"{where}: `docs-test: run` is for bash blocks only"
            code = "\n".join(lines[i + 1 : end]) + "\n"
            if kind == "python":
                assert ">>> " not in code, f"{where}: a block with >>> prompts is ```pycon"
            blocks.append(Block(kind, code, i + 2, text))
            pending = None
            i = end
        elif line.strip() and pending is not None:
            raise AssertionError(f"{rel(page)}:{pending[1]}: the marker is not before a block")
        i += 1
    assert pending is None, f"{rel(page)}:{pending[1]}: the marker is not before a block"
    return blocks


def rewrite(code: str, model_dir: Path, url: str) -> str:
    """The only two literals a page's examples are changed in before they run."""
    return code.replace(DEFAULT_MODEL, str(model_dir)).replace(DEFAULT_URL, url)


def run_python(page: str, block: Block, code: str, namespace: dict) -> None:
    # padded so that a traceback's line numbers are the page's
    compiled = compile("\n" * (block.line - 1) + code, page, "exec", dont_inherit=True)
    try:
        exec(compiled, namespace)
    except Exception:
        pytest.fail(f"{page}:{block.line}: python block failed\n{traceback.format_exc()}")


def run_pycon(page: str, block: Block, code: str, namespace: dict) -> None:
    test = doctest.DocTestParser().get_doctest(code, {}, f"{page}:{block.line}", page, 0)
    test.globs = namespace  # get_doctest copies: share the page's namespace instead
    test.lineno = block.line - 1  # doctest reports "File page, line N" from here
    report: list[str] = []
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    result = runner.run(test, out=report.append, clear_globs=False)
    if result.failed:
        pytest.fail(f"{page}:{block.line}: pycon block failed\n" + "".join(report))


def run_bash(page: str, block: Block, code: str) -> None:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=BASH_TIMEOUT_S,
    )
    if done.returncode != 0:
        pytest.fail(
            f"{page}:{block.line}: bash block exited {done.returncode}\n"
            f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )


def close_engines(namespace: dict) -> None:
    """Engines a page left open (its examples may leave one for the reader to use)."""
    from runtime.engine import Engine

    for value in list(namespace.values()):
        if isinstance(value, Engine):
            value.close()


@pytest.fixture(scope="module")
def default_backend(served):
    """`program.run(...)` as written: the default backend is the served tiny engine."""
    backend = fl.LocalBackend(served.engine)
    yield backend
    fl.set_default_backend(None)


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_page_examples_run(page, tiny_model_dir, served, default_backend):
    name = rel(page)
    blocks = parse_blocks(page)
    namespace: dict = {"__name__": f"docs:{name}"}
    ran, not_run = 0, 0
    fl.set_default_backend(default_backend)
    try:
        for block in blocks:
            code = rewrite(block.code, tiny_model_dir, served.url)
            if block.reason_not_run is not None:
                not_run += block.kind in ("python", "pycon")
                continue
            if block.kind == "python":
                run_python(name, block, code, namespace)
            elif block.kind == "pycon":
                run_pycon(name, block, code, namespace)
            elif block.kind == "bash" and block.marker == "run":
                run_bash(name, block, code)
            else:
                continue
            ran += block.kind in ("python", "pycon")
    finally:
        close_engines(namespace)
        fl.set_default_backend(default_backend)
    examples = sum(1 for b in blocks if b.kind in ("python", "pycon"))
    assert ran + not_run == examples, f"{name}: a python/pycon block neither ran nor says why"
    served.engine.check_integrity()


def test_every_docs_page_is_linked_from_the_readme():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    linked = {(ROOT / target.split("#")[0]).resolve() for target in LINK.findall(text)}
    missing = [rel(p) for p in PAGES[1:] if p.resolve() not in linked]
    assert not missing, f"README.md links none of {missing}"


def test_every_relative_link_points_at_a_file():
    broken = []
    for page in PAGES:
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            for target in LINK.findall(line):
                path = target.split("#")[0]
                if not path or re.match(r"[a-z]+:", path):  # an anchor, http:, mailto:
                    continue
                if not (page.parent / path).exists():
                    broken.append(f"{rel(page)}:{number}: {target}")
    assert not broken, "links to nothing:\n" + "\n".join(broken)


def layout_paths() -> tuple[list[str], set[Path]]:
    """docs/layout.md's map read: the names that do not exist (`file:line: name`), and every
    existing path it names (entries, and files their descriptions name)."""
    page = ROOT / "docs" / "layout.md"
    (block,) = [b for b in parse_blocks(page) if b.kind == "text"]
    parents: list[Path] = [ROOT]  # the folder of each indentation level
    base, missing, named_paths = ROOT, [], set()
    for number, line in enumerate(block.code.splitlines(), block.line):
        indent = len(line) - len(line.lstrip())
        words = line.split()
        if not words:
            continue
        if indent < 18:  # an entry (deeper lines continue the previous description)
            depth = indent // 2
            del parents[depth + 1 :]
            names = [words[0].rstrip(",")]
            for word, following in zip(words, words[1:], strict=False):
                if not word.endswith(","):
                    break
                names.append(following.rstrip(","))
            for name in names:
                if not (parents[depth] / name).exists():
                    missing.append(f"{rel(page)}:{number}: {name}")
                named_paths.add((parents[depth] / name).resolve())
            is_folder = names[0].endswith("/")
            base = parents[depth] / names[0] if is_folder else parents[depth]
            if is_folder:
                parents.append(base)
        for named in re.findall(r"[\w./-]+\.(?:py|html|md|sh|toml|ipynb)\b", line):
            if not ((base / named).exists() or (ROOT / named).exists() or "*" in named):
                missing.append(f"{rel(page)}:{number}: {named}")
            named_paths.update(p.resolve() for p in (base / named, ROOT / named) if p.exists())
    return list(dict.fromkeys(missing)), named_paths


def test_layout_names_only_existing_paths():
    """docs/layout.md's map: every entry, and every file a description names, exists."""
    missing, _ = layout_paths()
    assert not missing, "docs/layout.md names paths that do not exist:\n" + "\n".join(missing)


def test_layout_names_every_module():
    """...and the other direction: every module of the packages is in the map (a package's
    __init__.py is named by its folder)."""
    _, named = layout_paths()
    modules = [
        path
        for package in ("flowlang", "runtime", "programs")
        for path in (ROOT / package).rglob("*.py")
        if path.name != "__init__.py"
    ]
    unlisted = [rel(path) for path in sorted(modules) if path.resolve() not in named]
    assert not unlisted, "docs/layout.md does not list:\n" + "\n".join(unlisted)
