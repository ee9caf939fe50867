"""Hub ids resolve through huggingface_hub from a hub-layout cache built here (no network);
offline and uncached is a clear error; `flowlang models` lists what runs."""

from __future__ import annotations

import shutil

import pytest
from conftest import tiny_hf_model

from runtime.model.hub import HubModelNotCachedError, is_hub_id
from runtime.model.registry import ModelNotAvailableError, resolve_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"


def build_hub_cache(cache, repo_id: str, commit: str, source, ref: str | None = "main"):
    """What snapshot_download leaves behind: models--org--name/{snapshots/<commit>/, refs/}."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(source, repo / "snapshots" / commit)
    if ref is not None:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return repo / "snapshots" / commit


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """HF_HUB_CACHE at tmp_path/hub holding tiny-org/qwen3 (refs/main) and HF_HUB_OFFLINE=1."""
    model_dir = tmp_path / "src"
    tiny_hf_model("qwen3").save_pretrained(model_dir)
    cache = tmp_path / "hub"
    build_hub_cache(cache, "tiny-org/qwen3", COMMIT, model_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_hub_ids_are_told_from_paths():
    assert is_hub_id("Qwen/Qwen3-0.6B") and is_hub_id("Qwen/Qwen3-0.6B@main")
    assert not is_hub_id("./models/x") and not is_hub_id("/abs/x") and not is_hub_id("a/b/c")
    assert not is_hub_id("smollm2") and not is_hub_id("~/x")


def test_cached_hub_id_resolves_offline_and_serves(offline_cache):
    from runtime.config import EngineConfig
    from runtime.engine import Engine
    from runtime.protocol import GenerateRequest, SamplingParams

    folder = resolve_model("tiny-org/qwen3")
    assert folder == offline_cache / "models--tiny-org--qwen3" / "snapshots" / COMMIT
    params = SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True)
    with Engine(EngineConfig(model="tiny-org/qwen3", max_kv_tokens=1024)) as engine:
        (result,) = engine.generate([GenerateRequest(input_ids=[5, 6, 7], sampling=params)])
        assert engine.arch.model_type == "qwen3" and len(result.output_ids) == 3


def test_revisions_and_hf_home(tmp_path, monkeypatch, offline_cache):
    source = offline_cache / "models--tiny-org--qwen3" / "snapshots" / COMMIT
    build_hub_cache(offline_cache, "tiny-org/qwen3", OTHER, source, ref="v2")
    assert resolve_model("tiny-org/qwen3@v2").name == OTHER  # a tag or branch
    assert resolve_model(f"tiny-org/qwen3@{OTHER}").name == OTHER  # a commit
    # HF_HOME alone: the cache is $HF_HOME/hub
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    build_hub_cache(tmp_path / "home" / "hub", "other-org/m", COMMIT, source)
    assert resolve_model("other-org/m").parent.parent.parent == tmp_path / "home" / "hub"


def test_offline_and_not_cached_names_the_cache_and_the_fix(offline_cache):
    with pytest.raises(HubModelNotCachedError) as err:
        resolve_model("Qwen/Qwen3-0.6B@main")
    message = str(err.value)
    assert str(offline_cache) in message and "HF_HUB_OFFLINE is set" in message
    assert "`hf download Qwen/Qwen3-0.6B --revision main --include '*.json'" in message
    assert "--include '*.safetensors'" in message and "huggingface-cli" not in message


def test_an_unreachable_hub_is_not_blamed_on_hf_hub_offline(offline_cache, monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    from runtime.errors import UsageError

    def unreachable(repo_id, **kwargs):
        assert not kwargs["local_files_only"]
        try:
            raise ConnectionError("no route to huggingface.co")
        except ConnectionError as cause:
            raise LocalEntryNotFoundError("cannot find the snapshot") from cause

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    with pytest.raises(HubModelNotCachedError) as err:
        resolve_model("Qwen/Qwen3-0.6B")
    message = str(err.value)
    assert "the hub could not be reached (ConnectionError)" in message
    assert "HF_HUB_OFFLINE" not in message and isinstance(err.value, UsageError)
    assert "`hf download Qwen/Qwen3-0.6B --include '*.json'" in message
    assert "copy its models--Qwen--Qwen3-0.6B folder" in message
    assert str(offline_cache) in message


def test_a_model_the_hub_does_not_have_says_so(offline_cache, monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    def refused(kind):
        def snapshot_download(repo_id, **kwargs):
            raise kind.__new__(kind)  # the HTTP response these carry is not read

        return snapshot_download

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", refused(RepositoryNotFoundError))
    with pytest.raises(ModelNotAvailableError, match="hub has no model 'org/typo'.*hf auth login"):
        resolve_model("org/typo")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", refused(GatedRepoError))
    with pytest.raises(ModelNotAvailableError, match="gated: accept its terms"):
        resolve_model("org/gated")


def test_pickle_only_snapshot_is_refused(tmp_path, monkeypatch, offline_cache):
    src = tmp_path / "bin-only"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "pytorch_model.bin").write_bytes(b"")
    build_hub_cache(offline_cache, "tiny-org/bin", COMMIT, src)
    with pytest.raises(RuntimeError, match="only safetensors"):
        resolve_model("tiny-org/bin")


def test_names_that_are_nothing_say_what_is_accepted():
    with pytest.raises(FileNotFoundError, match="hub id"):
        resolve_model("no-such-model")


def test_flowlang_models_lists_families_without_torch():
    import subprocess
    import sys

    code = (
        "import sys; from flowlang.cli import main; main(['models']); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    for family in ("llama", "qwen3", "phi3", "smollm2-135m-instruct", "Qwen/Qwen3-0.6B"):
        assert family in out.stdout


def test_unsupported_architecture_lists_the_supported():
    import transformers

    from runtime.model.arch import ModelArch, UnsupportedModelError

    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    with pytest.raises(UnsupportedModelError, match="qwen3.*phi3.*flowlang models"):
        ModelArch.from_hf(config)
