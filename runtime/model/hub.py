"""Hugging Face Hub ids -> local snapshot folders, through `huggingface_hub.snapshot_download`.

`Qwen/Qwen3-0.6B` or `Qwen/Qwen3-0.6B@<revision>` (a branch, tag or commit). Only what the
engine reads is fetched: configs, safetensors weights, tokenizer files and chat templates
(never .bin/.pt pickles or GGUF). The Hugging Face environment is read here, at call time:
`HF_HUB_CACHE` (else `HF_HOME`/hub, else ~/.cache/huggingface/hub), `HF_HUB_OFFLINE`, and the
token (`HF_TOKEN` or the one `hf auth login` stored), which huggingface_hub picks up.
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
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

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
        raise HubModelNotCachedError(_not_cached_message(name, cache, offline, err)) from err
    except GatedRepoError as err:  # before its base class, RepositoryNotFoundError
        raise ModelNotAvailableError(
            f"hub model {repo_id!r} is gated: accept its terms on https://huggingface.co/"
            f"{repo_id}, then set HF_TOKEN or run `hf auth login`"
        ) from err
    except RepositoryNotFoundError as err:
        raise ModelNotAvailableError(
            f"the Hugging Face hub has no model {repo_id!r} (or it is private: set HF_TOKEN or "
            f"run `hf auth login`)"
        ) from err
    except RevisionNotFoundError as err:
        raise ModelNotAvailableError(
            f"hub model {repo_id!r} has no revision {revision!r} (a branch, tag or commit)"
        ) from err
    folder = Path(folder)
    if not any(folder.glob("*.safetensors")):
        raise ModelNotAvailableError(
            f"hub model {name!r} has no *.safetensors weights in {folder}; only safetensors "
            f"checkpoints are loaded (convert .bin weights with transformers' save_pretrained)"
        )
    return folder


def download_command(repo_id: str, revision: str = "") -> str:
    """The `hf download` line that fetches what the engine reads of a hub model."""
    includes = " ".join(f"--include '{pattern}'" for pattern in ALLOW_PATTERNS)
    return f"hf download {repo_id}{f' --revision {revision}' if revision else ''} {includes}"


def _not_cached_message(name: str, cache: Path, offline: bool, err: Exception) -> str:
    """Why an uncached model could not be fetched, and the ways to get it here."""
    repo_id, _, revision = name.partition("@")
    fill = (
        f"on a machine with network access run `{download_command(repo_id, revision)}` and "
        f"copy its models--{repo_id.replace('/', '--')} folder (from that machine's Hugging "
        f"Face cache) into {cache}"
    )
    if offline:
        return (
            f"{name!r} is not in the Hugging Face cache {cache}, and HF_HUB_OFFLINE is set, so "
            f"the hub was not asked.\nUnset HF_HUB_OFFLINE to download it, or {fill} "
            f"(gated models also need HF_TOKEN or `hf auth login`)."
        )
    cause = err.__cause__
    why = f" ({type(cause).__name__})" if cause is not None else ""
    return (
        f"{name!r} is not in the Hugging Face cache {cache}, and the hub could not be reached"
        f"{why}.\nCheck the network (or HTTPS_PROXY) and retry, or {fill}."
    )
