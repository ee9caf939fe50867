"""The native kernels' build: keyed by what makes a binary differ, shared between environments
(none rebuilds another's), compiled once when processes start together, and replaced by the
torch path, said once, where no compiler exists."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import sysconfig
import time

import pytest
import torch

from runtime.model.native import build

ROOT = pathlib.Path(__file__).resolve().parents[1]

# loads the kernels, checks one op against torch's arithmetic, prints where they came from
START = """
import sys, torch
from runtime.model.native import build, kernels
kernels.PROGRESS_EVERY_S = 5.0
kernels.start_building()
ops = kernels.load_cpu_kernels()
x, w = torch.randn(3, 64), torch.rand(64)
ref = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
assert torch.allclose(ops.rms_norm(x, w, 1e-6), ref, atol=1e-5)
print(kernels.kernel_status())
print(torch.__file__)
"""


def second_environment(folder: pathlib.Path) -> pathlib.Path:
    """A venv of its own (its own prefix) whose torch is this one's, reached through its own
    path: torch's headers then sit under another prefix, as in a second real venv."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    python = folder / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    site = pathlib.Path(purelib)
    (site / "torch").symlink_to(pathlib.Path(torch.__file__).parent)
    # the rest (numpy, pydantic, ...) from this environment, after its own torch
    (site / "this-env.pth").write_text(f"{sysconfig.get_paths()['purelib']}\n{ROOT}\n")
    return python


def start(python: pathlib.Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [str(python), "-c", START],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen) -> tuple[str, str]:
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err
    return out, err


def test_two_environments_share_one_build_and_never_rebuild_it(tmp_path):
    env = dict(os.environ, FLOWLANG_CACHE_DIR=str(tmp_path / "cache"))
    first = pathlib.Path(sys.executable)
    second = second_environment(tmp_path / "venv2")
    # both start at once on an empty cache: one compiles, the other waits for it
    outs = [finish(p) for p in [start(first, env), start(second, env)]]
    statuses = [out.splitlines()[0] for out, _ in outs]
    torch_files = {out.splitlines()[1] for out, _ in outs}
    assert len(torch_files) == 2  # two environments, each with torch under its own path
    assert sum(s.startswith("native (compiled now") for s in statuses) == 1, statuses
    assert sum(s.startswith("native (built by another process") for s in statuses) == 1
    compiled_err = next(err for (out, err) in outs if "compiled now" in out)
    assert "compiling the native CPU kernels" in compiled_err
    assert "compiling the CPU kernels: " in compiled_err  # progress while it ran
    waiter_err = next(err for (out, err) in outs if "another process" in out)
    assert "another process is compiling the CPU kernels; waiting" in waiter_err
    (library,) = (tmp_path / "cache" / "kernels").glob(f"*/{build.LIBRARY}")
    built = library.stat()
    time.sleep(0.01)
    # each environment starts again, twice as many times as it takes to see a rebuild
    for python in (first, second, first, second):
        out, err = finish(start(python, env))
        assert out.startswith(f"native (cached build {library.parent})"), out
        assert "compiling" not in err, err
    assert library.stat().st_mtime_ns == built.st_mtime_ns and library.stat().st_ino == built.st_ino
    assert not list(library.parent.glob("scratch-*"))  # nothing was even started
    assert len(list((tmp_path / "cache" / "kernels").iterdir())) == 2  # one build, its lock


def test_the_key_changes_with_the_sources_torch_compiler_and_cpu(tmp_path, monkeypatch):
    compiler = build.find_compiler()
    assert compiler is not None  # the test machine has one
    key = build.BuildKey.here(compiler)
    assert build.BuildKey.here(compiler) == key  # deterministic
    changed = tmp_path / "pointwise.cpp"
    changed.write_bytes(build.SOURCES[3].read_bytes() + b"\n// changed\n")
    monkeypatch.setattr(build, "SOURCES", (*build.SOURCES[:3], changed, *build.SOURCES[4:]))
    keys = {"sources": build.BuildKey.here(compiler)}
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__version__", "2.99.0+cpu")
    keys["torch"] = build.BuildKey.here(compiler)
    monkeypatch.undo()
    monkeypatch.setattr(build, "CFLAGS", (*build.CFLAGS, "-DNDEBUG"))
    keys["flags"] = build.BuildKey.here(compiler)
    monkeypatch.undo()
    monkeypatch.setattr(build, "cpu_identity", lambda: "GenuineIntel | 6 | 143 | avx2")
    keys["cpu"] = build.BuildKey.here(compiler)
    monkeypatch.undo()
    digests = {name: k.digest for name, k in keys.items()}
    assert key.digest not in digests.values() and len(set(digests.values())) == 4, digests
    # and a build made for one key is never found for another
    monkeypatch.setenv("FLOWLANG_CACHE_DIR", str(tmp_path / "cache"))
    key.folder.mkdir(parents=True)
    (key.folder / build.LIBRARY).write_bytes(b"")
    assert key.library == key.folder / build.LIBRARY
    assert all(k.library is None for k in keys.values())


GREEDY = """
from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.model.native import kernels
from runtime.protocol import GenerateRequest, SamplingParams
with Engine(EngineConfig(model="random:tiny", max_kv_tokens=256)) as engine:
    sampling = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    result = engine.generate(GenerateRequest(input_ids=list(range(1, 40)), sampling=sampling))[0]
    print(engine.runner.attention.name, type(engine.runner.model.ops).__name__)
    print(result.output_ids)
    print(kernels.kernel_status())
"""


def greedy(env: dict) -> subprocess.CompletedProcess:
    out = subprocess.run(
        [sys.executable, "-c", GREEDY], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return out


@pytest.mark.parametrize("why", ["no compiler", "disabled"])
def test_without_kernels_the_engine_says_so_once_and_runs_on_the_torch_path(tmp_path, why):
    native = greedy(dict(os.environ)).stdout.splitlines()
    assert native[0] == "cpu NativeCpuOps" and native[2].startswith("native (")
    env = dict(os.environ, FLOWLANG_CACHE_DIR=str(tmp_path / "cache"))
    if why == "no compiler":
        env["CXX"] = str(tmp_path / "no-such-c++")
    else:
        env["FLOWLANG_NATIVE_KERNELS"] = "0"
    out = greedy(env)
    backend, ids, status = out.stdout.splitlines()
    assert backend == "torch TorchOps"
    assert ids == native[1]  # the same greedy tokens as the native kernels
    wanted = "no C++ compiler" if why == "no compiler" else "FLOWLANG_NATIVE_KERNELS=0"
    assert status.startswith("torch path: ") and wanted in status
    said = [line for line in out.stderr.splitlines() if wanted in line]
    assert len(said) == 1 and "running on the torch path" in said[0], out.stderr
    assert "Traceback" not in out.stderr


def test_the_engine_starts_the_build_before_it_loads_the_model(tiny_model_dir, monkeypatch):
    import runtime.engine_build as build_module
    from runtime.config import EngineConfig
    from runtime.engine import Engine

    calls = []
    real_resolve = build_module.resolve_model
    monkeypatch.setattr(build_module, "start_building_kernels", lambda: calls.append("build"))
    monkeypatch.setattr(
        build_module, "resolve_model", lambda name: calls.append("model") or real_resolve(name)
    )
    Engine(EngineConfig(model=str(tiny_model_dir), max_kv_tokens=256)).close()
    assert calls == ["build", "model"]
