"""The native CPU kernels built once per machine and torch build, shared by every environment.

A build is keyed by everything that makes its binary differ (`BuildKey`): the kernel sources,
torch's build (version, git revision, C++ ABI, libtorch's size), Python's version, the compiler
and its flags, and the CPU's features (the flags say -march=native). It lives in
$FLOWLANG_CACHE_DIR/kernels/cpu-<digest>/ and later processes load it from there directly, in
milliseconds. No build file is compared on load, so two environments with the same torch share
one build and never rebuild each other's: torch's own extension cache keys a build by its name
alone and recompiles whenever another environment's include paths appear in its build.ninja.

A build runs in a child process of its own (`start_build`, `python -m runtime.model.native.build`)
while its parent holds a file lock, so concurrent processes compile once and a parent that exits
(an error, ^C) takes its compiler processes with it; torch.utils.cpp_extension does the
compiling (ninja, torch's flags and ABI) in a scratch folder whose library is moved into place
when complete.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

CSRC = Path(__file__).parent / "csrc"
SOURCES = tuple(
    CSRC / name
    for name in (
        "paged_attention.cpp",
        "flash.cpp",
        "merge_attention.cpp",
        "pointwise.cpp",
        "panel_gemm.cpp",
        "threads.cpp",
        "quant_gemm.cpp",
        "decode_layers.cpp",
    )
)
HEADERS = (CSRC / "avx512_math.h", CSRC / "ops.h")
CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp")
LDFLAGS = ("-fopenmp",)
LIBRARY = "flowlang_kernels.so"
FAILED_LOG = "build-failed.log"


class KernelBuildError(RuntimeError):
    """The native kernels cannot be built or loaded here (the message says why)."""


@dataclass(frozen=True)
class BuildKey:
    """What a build's binary depends on; equal keys may share one build."""

    sources_sha256: str
    torch: str  # version, git revision, C++ ABI, libtorch_cpu's size in bytes
    python: str
    compiler: str  # path and the first line of --version
    flags: str
    cpu: str  # vendor, family, model, feature flags

    @property
    def digest(self) -> str:
        text = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(text).hexdigest()[:16]

    @property
    def folder(self) -> Path:
        return kernels_root() / f"cpu-{self.digest}"

    @property
    def library(self) -> Path | None:
        """The finished build, if one exists (the library is moved in last)."""
        library = self.folder / LIBRARY
        return library if library.is_file() else None

    @classmethod
    def here(cls, compiler: str) -> BuildKey:
        """This process's key, for the compiler at path `compiler`."""
        import torch

        sources = hashlib.sha256(b"".join(p.read_bytes() for p in (*SOURCES, *HEADERS)))
        libtorch = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
        size = libtorch.stat().st_size if libtorch.exists() else 0
        abi = int(torch.compiled_with_cxx11_abi())
        return cls(
            sources_sha256=sources.hexdigest(),
            torch=f"{torch.__version__} {torch.version.git_version} abi{abi} {size}",
            python=platform.python_version(),
            compiler=f"{compiler} {compiler_version(compiler)}",
            flags=" ".join((*CFLAGS, *LDFLAGS)),
            cpu=cpu_identity(),
        )


def find_compiler() -> str | None:
    """The C++ compiler torch's builder uses ($CXX, else c++), as a path; None if absent."""
    return shutil.which(os.environ.get("CXX") or "c++")


def compiler_version(compiler: str) -> str:
    try:
        out = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise KernelBuildError(f"the C++ compiler {compiler} does not run: {err}") from err
    return (out.stdout.splitlines() or ["?"])[0]


def cpu_identity() -> str:
    """The first CPU's vendor, family, model and flags from /proc/cpuinfo (what -march=native
    reads), else what the platform module knows."""
    wanted = ("vendor_id", "cpu family", "model", "flags")
    fields: dict[str, str] = {}
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
        for line in cpuinfo:
            name, _, value = line.partition(":")
            name = name.strip()
            if name in wanted and name not in fields:
                fields[name] = value.strip()
            if not line.strip() and fields:
                break  # the first processor's block is enough
    if not fields:
        return f"{platform.machine()} {platform.processor()}"
    return " | ".join(fields.get(name, "") for name in wanted)


def kernels_root() -> Path:
    """Where builds live: the models' cache folder's kernels/ (FLOWLANG_CACHE_DIR)."""
    from runtime.model.registry import cache_dir

    return cache_dir() / "kernels"


def files_compiled(key: BuildKey) -> int:
    """Object files a running build has finished so far."""
    return len(list(key.folder.glob("scratch-*/*.o")))


@contextlib.contextmanager
def build_lock(key: BuildKey, say: Callable[[str], None]) -> Iterator[None]:
    """Exclusive across processes (released if the holder dies); says so when it waits."""
    kernels_root().mkdir(parents=True, exist_ok=True)
    with open(kernels_root() / f"cpu-{key.digest}.lock", "a+b") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say("another process is compiling the CPU kernels; waiting for it")
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def start_build(key: BuildKey) -> subprocess.Popen:
    """The build of `key` in a child process (a session of its own, killed with its compilers
    if this process exits first), while the caller holds build_lock; it exits 0 once the
    library is in place."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    child = subprocess.Popen(
        [sys.executable, "-m", "runtime.model.native.build", key.digest],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    atexit.register(_kill_unfinished, child)
    return child


def _kill_unfinished(child: subprocess.Popen) -> None:
    if child.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)


def failure(key: BuildKey) -> KernelBuildError:
    """What a failed build left in its log, as one short error."""
    log = key.folder / FAILED_LOG
    text = log.read_text(errors="replace") if log.exists() else "no log"
    first = next((line for line in text.splitlines() if "error" in line.lower()), text[:200])
    return KernelBuildError(f"compiling the CPU kernels failed ({log}): {first.strip()}")


def build_library(key: BuildKey) -> None:
    """Compile the kernels for `key` into their folder (the caller holds the build lock).
    Failures go to the folder's build-failed.log."""
    from torch.utils.cpp_extension import load

    folder = key.folder
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("scratch-*"):  # left by a killed build
        shutil.rmtree(stale, ignore_errors=True)
    (folder / FAILED_LOG).unlink(missing_ok=True)
    scratch = folder / f"scratch-{os.getpid()}"
    scratch.mkdir()
    name = f"flowlang_kernels_{key.digest}"
    try:
        load(
            name=name,
            sources=[str(p) for p in SOURCES],
            extra_cflags=list(CFLAGS),
            extra_ldflags=list(LDFLAGS),
            build_directory=str(scratch),
            is_python_module=False,
            verbose=False,
        )
    except (RuntimeError, OSError, ImportError) as err:
        (folder / FAILED_LOG).write_text(str(err))
        raise
    (folder / "key.json").write_text(json.dumps(asdict(key), indent=1))
    os.replace(scratch / f"{name}.so", folder / LIBRARY)  # complete: later loads find it
    shutil.rmtree(scratch, ignore_errors=True)


def load_library(path: Path) -> None:
    """Register a finished build's ops in this process."""
    import torch

    try:
        torch.ops.load_library(str(path))
    except OSError as err:
        raise KernelBuildError(f"loading the CPU kernels {path} failed: {err}") from err


def say(message: str) -> None:
    """One line on stderr, written whole (other threads print too)."""
    sys.stderr.write(f"[flowlang] {message}\n")
    sys.stderr.flush()


def main(argv: list[str]) -> int:
    """The child's side of start_build: build for this environment's key, which must be the
    parent's (`argv[0]`, its digest); the parent holds the lock."""
    compiler = find_compiler()
    key = BuildKey.here(compiler) if compiler is not None else None
    if key is None or key.digest != argv[0]:  # say so where the parent looks
        folder = kernels_root() / f"cpu-{argv[0]}"
        folder.mkdir(parents=True, exist_ok=True)
        seen = "no compiler" if key is None else f"key {key.digest}"
        (folder / FAILED_LOG).write_text(f"error: the build process found {seen}")
        return 2
    try:
        build_library(key)
    except (RuntimeError, OSError, ImportError):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
