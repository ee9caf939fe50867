"""Layering: `import flowlang` works without torch; `runtime` never imports `flowlang`, and
`flowlang` imports only torch-free `runtime` modules and never its workloads (`programs`
reaches the CLI through an entry point)."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

BLOCK_TORCH = """
import sys

import pytest
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


def imported_modules(path: pathlib.Path, top_level_only: bool = False) -> list[str]:
    """Every module `path` imports; those imported at module level only, if asked."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in tree.body if top_level_only else ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append(node.module)
    return found


def test_runtime_never_imports_flowlang_or_programs():
    offenders = [
        f"{path.relative_to(ROOT)}: {module}"
        for path in (ROOT / "runtime").rglob("*.py")
        for module in imported_modules(path)
        if module.split(".")[0] in ("flowlang", "programs")
    ]
    assert not offenders, offenders


# Inside the runtime, lower layers never load upper ones, not even through another module:
# the model knows nothing of requests or scheduling, the cache nothing of models or requests.
RUNTIME_LAYERS = {
    "runtime.model.runner": ("runtime.scheduler", "runtime.generation", "runtime.engine"),
    "runtime.model.sampler": ("runtime.scheduler", "runtime.generation", "runtime.engine"),
    "runtime.constrain.grammar": ("runtime.scheduler", "runtime.generation", "runtime.engine"),
    "runtime.cache.radix": ("runtime.model", "runtime.scheduler", "runtime.engine"),
    "runtime.cache.base": ("runtime.model", "runtime.scheduler", "runtime.engine"),
    "runtime.cache.graph_policy": ("runtime.model", "runtime.scheduler", "runtime.engine"),
    "runtime.cache.replay": ("runtime.model", "runtime.scheduler", "runtime.engine"),
    "runtime.scheduler.scheduler": ("runtime.engine", "runtime.model.runner", "runtime.server"),
}

LOADED_BY = """
import importlib, sys
importlib.import_module(sys.argv[1])
print(" ".join(m for m in sys.modules if m.startswith("runtime")))
"""


@pytest.mark.parametrize("module", sorted(RUNTIME_LAYERS))
def test_runtime_lower_layers_never_load_upper_ones(module):
    out = subprocess.run(
        [sys.executable, "-c", LOADED_BY, module],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    loaded = out.stdout.split()
    assert module in loaded
    bad = [m for m in loaded for upper in RUNTIME_LAYERS[module] if m.startswith(upper)]
    assert not bad, f"importing {module} loads {bad}"


TORCH_FREE_RUNTIME = {
    "runtime.protocol",
    "runtime.prefix",
    "runtime.errors",
    "runtime.svg",
    "runtime.constrain.tool_calls",
    "runtime.constrain.reasoning",
    "runtime.constrain.tool_prompt",
    "runtime.telemetry",  # opentelemetry only when tracing is on (flowlang's program spans)
    "runtime.batches.lines",  # run_batch(results=...) writes the batch file format
    "runtime.batches.results_file",
}


def test_flowlang_imports_only_torch_free_runtime_modules_at_module_level():
    offenders = [
        f"{path.relative_to(ROOT)}: {module}"
        for path in (ROOT / "flowlang").rglob("*.py")
        for module in imported_modules(path, top_level_only=True)
        if module.split(".")[0] == "runtime" and module not in TORCH_FREE_RUNTIME
    ]
    assert not offenders, offenders


def test_flowlang_never_imports_its_workloads():
    offenders = [
        f"{path.relative_to(ROOT)}: {module}"
        for path in (ROOT / "flowlang").rglob("*.py")
        for module in imported_modules(path)
        if module.split(".")[0] == "programs"
    ]
    assert not offenders, offenders


def test_demo_reaches_the_cli_through_its_entry_point(capsys):
    from flowlang.cli import main

    for command in ("demo", "serve"):
        with pytest.raises(SystemExit) as exit_info:
            main([command, "--help"])
        assert exit_info.value.code == 0
        assert f"usage: flowlang {command}" in capsys.readouterr().out
