"""No module uses another module's private names (a leading underscore means "this file only").

Two rules, checked over the packages (tests may poke at internals):
- no `from x import _name` and no `module._name` of an imported module;
- no `obj._name` attribute use unless this module itself defines `_name` (a function, class,
  assignment, `self._name = ...`, or a slot): reaching into another module's objects otherwise.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("flowlang", "runtime", "programs")


# os._exit, namedtuple's public API; torch's CPU flash attention op, the only CPU attention
# that returns the log-sum-exp (cascade attention merges partial results by it)
DOCUMENTED = {
    "_exit",
    "_asdict",
    "_replace",
    "_fields",
    "_scaled_dot_product_flash_attention_for_cpu",
}


def _private(name: str) -> bool:
    if name in DOCUMENTED:
        return False
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _defined_here(tree: ast.AST) -> set[str]:
    """Private names this module defines or binds itself."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store | ast.Del):
            names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)  # __slots__ entries, getattr(self, "_x")
    return {n for n in names if _private(n)}


def offenders_in(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    own = _defined_here(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            names = [a.name for a in node.names if _private(a.name)]
            found += [f"imports {name} from {node.module}" for name in names]
        elif isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in own:
            found.append(f"line {node.lineno}: uses .{node.attr}, defined elsewhere")
    return [f"{path.relative_to(root)}: {f}" for f in found]


def test_no_module_uses_another_modules_private_names():
    offenders = [o for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") for o in offenders_in(p)]
    assert not offenders, "\n".join(offenders)


def test_the_checker_finds_what_it_is_for(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from runtime.engine import _helper\nimport os\n\n\ndef f(engine):\n"
        "    return engine._commands, os._getpid\n"
    )
    found = offenders_in(bad, tmp_path)
    assert len(found) == 3, found  # the import, engine._commands, os._getpid
