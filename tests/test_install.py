"""The README's install gives the CPU build of torch on any machine, ends without pip's red
dependency ERROR, and is what CI runs."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
GPU_PACKAGES = ("nvidia-", "cuda-", "triton", "cupy")


def readme_command(name: str) -> list[list[str]]:
    """The README's command `name` as CI reads it (.ci/readme_command), split into its steps."""
    out = subprocess.run(
        [str(ROOT / ".ci" / "readme_command"), name], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip(), f"the README has no '{name}' command"
    return [shlex.split(step) for step in out.stdout.strip().split(" && ")]


def pip_installs(steps: list[list[str]]) -> list[list[str]]:
    return [step[2:] for step in steps if step[:2] == [".venv/bin/pip", "install"]]


@pytest.mark.parametrize("name", ["main", "tests"])
def test_the_readme_takes_torch_from_the_cpu_index_and_installs_no_deps_packages_last(name):
    installs = pip_installs(readme_command(name))
    first = installs[0]
    (torch_pin,) = [a for a in first if a.startswith("torch")]
    assert torch_pin == f"torch=={torch.__version__}"  # the CPU build CI runs, `+cpu` pinned
    assert torch_pin.endswith("+cpu") and "--no-deps" in first
    assert first[first.index("--index-url") + 1] == CPU_INDEX
    project = pyproject()
    (torch_range,) = [r for r in map(Requirement, project["dependencies"]) if r.name == "torch"]
    assert torch.__version__ in torch_range.specifier  # so no later step replaces it
    editable = next(i for i, args in enumerate(installs) if "-e" in args)
    # a --no-deps package whose declared dependencies are missing makes every later install's
    # dependency check end in a red ERROR: they come after the project
    no_deps = [i for i, args in enumerate(installs) if "--no-deps" in args]
    assert no_deps[0] == 0 and all(i > editable for i in no_deps[1:]), installs


def test_ci_runs_the_readmes_commands():
    script = (ROOT / ".ci" / "run").read_text()
    assert "for name in main tests" in script and ".ci/readme_command" in script


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_on_a_pypi_only_machine_the_project_adds_no_gpu_package():
    """With the README's torch in place and pip configured for PyPI alone (no local wheel
    folder, no site config), resolving the project with its dev extra installs nothing that
    is CUDA's and never replaces torch."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1")
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", "-"]
    out = subprocess.run(
        [*cmd, "-e", f"{ROOT}[dev]"], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr
    names = [item["metadata"]["name"].lower() for item in json.loads(out.stdout)["install"]]
    assert "torch" not in names, names
    assert not [n for n in names if n.startswith(GPU_PACKAGES)], names
