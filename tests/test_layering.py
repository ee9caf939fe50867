"""Layering: `import flowlang` works without torch; `runtime` never imports `flowlang`."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

BLOCK_TORCH = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this test")
sys.meta_path.insert(0, Block())
import flowlang, runtime
assert "torch" not in sys.modules
print("ok")
"""


def test_flowlang_imports_without_torch():
    out = subprocess.run(
        [sys.executable, "-c", BLOCK_TORCH], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_runtime_never_imports_flowlang():
    offenders = []
    for path in (ROOT / "runtime").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [
                f"{path.relative_to(ROOT)}: {n}"
                for n in names
                if n == "flowlang" or n.startswith("flowlang.")
            ]
    assert not offenders, offenders
