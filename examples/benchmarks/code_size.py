"""How readable the core is: the Engine and Scheduler classes and the longest functions.

    python examples/benchmarks/code_size.py [ROOT]

Counts lines with the AST over flowlang/, runtime/ and programs/ of ROOT (default: this
checkout), so two checkouts compare side by side.
"""

from __future__ import annotations

import ast
import pathlib
import sys

PACKAGES = ("flowlang", "runtime", "programs")
CLASSES = ("Engine", "Scheduler")


def main() -> None:
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).parents[2])
    functions: list[tuple[int, str]] = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    continue
                lines = node.end_lineno - node.lineno + 1
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    functions.append((lines, f"{path.relative_to(root)}:{node.name}"))
                elif isinstance(node, ast.ClassDef) and node.name in CLASSES:
                    methods = sum(isinstance(n, ast.FunctionDef) for n in node.body)
                    print(f"class {node.name}: {lines} lines, {methods} methods")
    functions.sort(reverse=True)
    print(f"functions over 60 lines: {sum(n > 60 for n, _ in functions)}")
    for lines, name in functions[:5]:
        print(f"  {lines:4d}  {name}")


if __name__ == "__main__":
    main()
