"""The shape of the product code, read from the source: what issue 51 measures, per tree.

    python examples/benchmarks/code_shape.py [--tree NAME=PATH ...]

Columns per tree (product code: flowlang/, runtime/, programs/):
  product lines; functions over 60 lines (and the longest); class lines of Engine, Scheduler,
  KVManager and RadixCache; files over 600 lines; checks whether a lower tier is there (`tiers
  is None`, `host is None`, `disk is None` and their `is not None` forms); attributes assigned
  onto the tree from outside (`.cache.X = ...` for the tree's hooks); `isinstance` on the
  cache outside runtime/cache; duplicate pairs (the `duplicates` command, where installed);
  EngineConfig fields that `flowlang serve --help` does not offer and no exclusion names.
"""

from __future__ import annotations

import argparse
import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

PACKAGES = ("flowlang", "runtime", "programs")
CLASSES = {
    "Engine": "runtime/engine.py",
    "Scheduler": "runtime/scheduler/scheduler.py",
    "KVManager": "runtime/scheduler/kv.py",
    "RadixCache": "runtime/cache/radix.py",
}
TIER_CHECK = re.compile(r"\b(tiers|host|disk) is (not )?None\b")
TREE_HOOK = re.compile(r"\bcache\.(event_sink|demote_sink|token_index)\s*=[^=]")
CACHE_ISINSTANCE = re.compile(r"isinstance\([^,]*cache[^,]*,")


def product_files(root: Path) -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (root / pkg).rglob("*.py"))


def long_functions(files: list[Path], root: Path) -> list[tuple[int, str]]:
    found = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > 60:
                    found.append((lines, f"{path.relative_to(root)}:{node.name}"))
    return sorted(found, reverse=True)


def class_lines(root: Path, name: str, rel: str) -> int | None:
    path = root / rel
    if not path.exists():
        return None
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node.end_lineno - node.lineno + 1
    return None


def duplicate_pairs(root: Path) -> str:
    """Pairs the `duplicates` command finds with both sides in product code."""
    if shutil.which("duplicates") is None:
        return "-"
    out = subprocess.run(
        ["duplicates", "--repo", str(root), "--most", "200", "--seconds", "120"],
        capture_output=True, text=True, check=False,
    ).stdout  # fmt: skip
    sides = re.findall(r"^D\d+ (\S+?):\d+-\d+ ~ (\S+?):\d+", out, re.MULTILINE)
    product = [a for a, b in sides if a.startswith(PACKAGES) and b.startswith(PACKAGES)]
    return str(len(product))


def unreachable_fields(root: Path) -> str:
    """EngineConfig fields `flowlang serve` offers no option for and does not exclude."""
    script = (
        "import argparse, flowlang.cli as c\n"
        "from runtime.config import EngineConfig\n"
        "p = argparse.ArgumentParser(); sub = p.add_subparsers()\n"
        "c.add_serve(sub)\n"
        "serve = sub.choices['serve']\n"
        "opts = {s for a in serve._actions for s in a.option_strings}\n"
        "import flowlang.serve_options as o\n"
        "excluded = set(getattr(o, 'NOT_OPTIONS', ()))\n"
        "print(sorted(f for f in EngineConfig.model_fields\n"
        "      if '--' + f.replace('_', '-') not in opts and f not in excluded))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], cwd=root, capture_output=True, text=True, check=False
    )
    if run.returncode:
        return "(no serve_options: options written by hand)"
    return run.stdout.strip()


def shape(root: Path) -> dict[str, str]:
    files = product_files(root)
    texts = {p: p.read_text() for p in files}
    longest = long_functions(files, root)
    rel = {p: str(p.relative_to(root)) for p in files}
    return {
        "product lines": f"{sum(t.count(chr(10)) for t in texts.values()):,}",
        "functions over 60 lines": f"{len(longest)}"
        + (f" ({', '.join(f'{n} {w}' for n, w in longest[:4])})" if longest else ""),
        **{f"`{c}` class lines": str(class_lines(root, c, f)) for c, f in CLASSES.items()},
        "files over 600 lines": ", ".join(
            f"{rel[p]} {t.count(chr(10))}" for p, t in texts.items() if t.count("\n") > 600
        )
        or "0",
        "None-tier checks": str(sum(len(TIER_CHECK.findall(t)) for t in texts.values())),
        "hooks assigned onto the tree from outside": str(
            sum(len(TREE_HOOK.findall(t)) for t in texts.values())
        ),
        "isinstance on the cache outside runtime/cache": str(
            sum(
                len(CACHE_ISINSTANCE.findall(t))
                for p, t in texts.items()
                if not rel[p].startswith("runtime/cache/")
            )
        ),
        "duplicate pairs (product)": duplicate_pairs(root),
        "EngineConfig fields not in serve --help nor excluded": unreachable_fields(root),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tree", action="append", default=[], help="NAME=PATH (default: .)")
    args = parser.parse_args()
    trees = [t.split("=", 1) for t in args.tree] or [["this", "."]]
    shapes = [(name, shape(Path(path).resolve())) for name, path in trees]
    print("| | " + " | ".join(name for name, _ in shapes) + " |")
    print("| --- |" + " --- |" * len(shapes))
    for key in shapes[0][1]:
        print(f"| {key} | " + " | ".join(s[key] for _, s in shapes) + " |")


if __name__ == "__main__":
    main()
