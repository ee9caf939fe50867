"""Loading Hugging Face folders: single and sharded safetensors, tied and untied embeddings."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_hf_model

from runtime.model.batch import ForwardBatch
from runtime.model.loader import CheckpointError, load_checkpoint
from runtime.model.runner import ModelRunner


@pytest.mark.parametrize("kind, shard", [("llama", None), ("llama3", "40KB"), ("qwen2", "40KB")])
def test_folder_roundtrip(tmp_path, kind, shard):
    hf = tiny_hf_model(kind)
    hf.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
    if shard:
        assert (tmp_path / "model.safetensors.index.json").is_file()
    runner = ModelRunner.from_checkpoint(tmp_path, num_slots=64)
    assert runner.arch.tie_word_embeddings == hf.config.tie_word_embeddings
    ids = list(range(3, 30))
    out = runner.forward(ForwardBatch.build([ids], [torch.arange(len(ids))], all_logits=[True]))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (out - ref).abs().max() < 1e-4


def test_bad_folder_errors(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        load_checkpoint(tmp_path)
    tiny_hf_model("llama").config.save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_checkpoint(tmp_path)
