"""Hugging Face Hub ids -> local snapshot folders, through `huggingface_hub.snapshot_download`.

`Qwen/Qwen3-0.6B` or `Qwen/Qwen3-0.6B@<revision>` (a branch, tag or commit). Only what the
engine reads is fetched: configs, safetensors weights, tokenizer files and chat templates
(never .bin/.pt pickles or GGUF). The Hugging Face environment is read here, at call time:
`HF_HUB_CACHE` (else `HF_HOME`/hub, else ~/.cache/huggingface/hub), `HF_HUB_OFFLINE`, and the
token (`HF_TOKEN` or the one `huggingface-cli login` stored), which huggingface_hub picks up.
"""

from __future__ import annotations

import os
from pathlib import Path

from runtime.model.registry import ModelNotAvailableError

ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.txt"]
_TRUE = ("1", "on", "yes", "true")


class HubModelNotCachedError(ModelNotAvailableError):
    """Offline, and the hub model is not in the local cache; the message says how to fill it."""


def is_hub_id(name: str) -> bool:
    """`org/name` or `org/name@revision`, as opposed to a relative or absolute path."""
    repo_id = name.split("@", 1)[0]
    parts = repo_id.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~", "/"))


def hub_cache_dir() -> Path:
    """Where huggingface_hub keeps snapshots: $HF_HUB_CACHE, else $HF_HOME/hub, else default."""
    if cache := os.environ.get("HF_HUB_CACHE"):
        return Path(cache).expanduser()
    home = os.environ.get("HF_HOME") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "huggingface"
    )
    return Path(home).expanduser() / "hub"


def hub_offline() -> bool:
    """HF_HUB_OFFLINE set to a true value."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def resolve_hub_model(name: str) -> Path:
    """The snapshot folder of hub id `name` (`org/model[@revision]`), downloaded if needed."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    repo_id, _, revision = name.partition("@")
    cache, offline = hub_cache_dir(), hub_offline()
    try:
        folder = snapshot_download(
            repo_id,
            revision=revision or None,
            cache_dir=cache,
            local_files_only=offline,
            allow_patterns=ALLOW_PATTERNS,
        )
    except LocalEntryNotFoundError as err:
        why = "HF_HUB_OFFLINE is set" if offline else "the hub could not be reached"
        raise HubModelNotCachedError(
            f"{name!r} is not in the Hugging Face cache {cache} and {why}.\n"
            f"Fill the cache on a machine with network access and copy it here: "
            f"`HF_HUB_CACHE={cache} huggingface-cli download {repo_id}"
            f"{f' --revision {revision}' if revision else ''}"
            f" --include '*.json' '*.safetensors' 'tokenizer*'`, or unset HF_HUB_OFFLINE "
            f"(gated models also need HF_TOKEN)."
        ) from err
    folder = Path(folder)
    if not any(folder.glob("*.safetensors")):
        raise ModelNotAvailableError(
            f"hub model {name!r} has no *.safetensors weights in {folder}; only safetensors "
            f"checkpoints are loaded (convert .bin weights with transformers' save_pretrained)"
        )
    return folder
