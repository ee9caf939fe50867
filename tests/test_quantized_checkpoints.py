"""Quantized Hugging Face checkpoints load as the plain weights they encode.

Each layout (compressed-tensors FP8 per tensor and per channel, transformers' block-wise FP8,
AWQ gemm, GPTQ v1 with act-order and v2) is written here from the tiny model's fp32 linear
weights by a quantizer that follows the format's definition, independently of the loader: the
loader's weights must equal this file's dequantization of what it wrote, bit for bit, and an
engine on the quantized folder must generate the tokens an engine on a plain folder of those
weights does. Refused configs and incomplete checkpoints are CheckpointErrors naming the cause.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from conftest import save_tiny_model
from safetensors.torch import load_file, save_file

from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.model.loader import CheckpointError, load_checkpoint
from runtime.protocol import GenerateRequest, SamplingParams

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: nibble i of a packed int32 holds column ORDER[i]
GREEDY = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
PROMPTS = [[(13 * j) % 900 + 20 for j in range(n)] for n in (7, 25)]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(scope="module")
def plain(tmp_path_factory, default_model_path) -> Path:
    """The tiny Llama (hidden 64, MLP 128, 2 layers) as an fp32 folder with a tokenizer."""
    return save_tiny_model(tmp_path_factory.mktemp("plain"), default_model_path)


def is_linear(name: str) -> bool:
    return name.startswith("model.layers.") and name.endswith("_proj.weight")


def to_int32(packed: torch.Tensor) -> torch.Tensor:
    """int64 holding 32-bit patterns -> int32 with the same bits."""
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def pack(values: torch.Tensor, bits: int, dim: int, order: list[int] | None = None):
    """Integers packed 32 // bits to an int32 along `dim`, value i at bits i*bits (low first);
    value i of packed index c is element per*c + order[i]."""
    per = 32 // bits
    order = order or list(range(per))
    values = values.long().movedim(dim, 0)
    packed = torch.zeros(values.shape[0] // per, *values.shape[1:], dtype=torch.long)
    for i, pos in enumerate(order):
        packed |= values[pos::per] << (bits * i)
    return to_int32(packed).movedim(0, dim).contiguous()


# FP8: scale = amax / 448 over what the scale covers; W = fp8 * scale


def fp8_per_tensor(w, rng):
    scale = (w.abs().max() / FP8_MAX).reshape(1)
    q = (w / scale).to(FP8)
    tensors = {"weight": q, "weight_scale": scale, "input_scale": torch.tensor([0.02])}
    return tensors, q.float() * scale


def fp8_per_channel(w, rng):
    scale = w.abs().amax(1, keepdim=True) / FP8_MAX  # [out, 1]
    q = (w / scale).to(FP8)
    return {"weight": q, "weight_scale": scale.to(torch.bfloat16)}, q.float() * scale.bfloat16()


def fp8_blocks(w, rng, block=(48, 40)):
    """Blocks that do not divide 64 or 128: the edge blocks are cropped."""
    (rows, cols), (bo, bi) = w.shape, block
    scale = torch.empty(-(-rows // bo), -(-cols // bi))
    q, ref = torch.empty(w.shape, dtype=FP8), torch.empty_like(w)
    for r in range(scale.shape[0]):
        for c in range(scale.shape[1]):
            part = (slice(r * bo, (r + 1) * bo), slice(c * bi, (c + 1) * bi))
            scale[r, c] = w[part].abs().max() / FP8_MAX
            q[part] = (w[part] / scale[r, c]).to(FP8)
            ref[part] = q[part].float() * scale[r, c]
    return {"weight": q, "weight_scale_inv": scale}, ref


# integer groups: per (group, output) an fp16 scale and a zero in zero_range; W = (q - z) * s


def int_groups(wt, g_idx, bits, zero_range):
    """wt [in, out] quantized per group of input rows: (q, z, s, reference W [out, in])."""
    maxq, groups = 2**bits - 1, int(g_idx.max()) + 1
    s = torch.empty(groups, wt.shape[1])
    z = torch.empty(groups, wt.shape[1], dtype=torch.long)
    for g in range(groups):
        rows = wt[g_idx == g]
        lo, hi = rows.min(0).values.clamp(max=0), rows.max(0).values.clamp(min=0)
        s[g] = (hi - lo).clamp(min=1e-5) / maxq
        z[g] = (-lo / s[g]).round().clamp(*zero_range)
    s = s.half()
    q = ((wt / s.float()[g_idx]).round() + z[g_idx]).clamp(0, maxq).long()
    ref = ((q - z[g_idx]).float() * s.float()[g_idx]).t().contiguous()
    return q, z, s, ref


def awq(w, rng, group=32):
    g_idx = torch.arange(w.shape[1]) // group
    q, z, s, ref = int_groups(w.t(), g_idx, 4, (0, 15))
    packed = {"qweight": pack(q, 4, 1, AWQ_ORDER), "qzeros": pack(z, 4, 1, AWQ_ORDER)}
    return packed | {"scales": s}, ref


def gptq(w, rng, bits=4, group=32, v1=True):
    """Act-order: input rows join groups in a random order (g_idx permuted). v1 stores z - 1;
    its zeros start at 1, since GPTQ v1 cannot store z = 0 (that is why v2 exists)."""
    perm = torch.randperm(w.shape[1], generator=rng)
    g_idx = torch.empty(w.shape[1], dtype=torch.long)
    g_idx[perm] = torch.arange(w.shape[1]) // group
    q, z, s, ref = int_groups(w.t(), g_idx, bits, (int(v1), 2**bits - 1))
    tensors = {"qweight": pack(q, bits, 0), "qzeros": pack(z - int(v1), bits, 1), "scales": s}
    return tensors | {"g_idx": g_idx.to(torch.int32)}, ref


def gptq_v2(w, rng, bits=4):
    return gptq(w, rng, bits=bits, group=48 if bits == 8 else 32, v1=False)


CT_GROUP = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "symmetric": True}}
LAYOUTS = {
    "ct-tensor": (
        {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {
                "group_0": {
                    **CT_GROUP,
                    "weights": {**CT_GROUP["weights"], "strategy": "tensor"},
                    "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor"},
                }
            },
            "ignore": ["lm_head"],
        },
        fp8_per_tensor,
    ),
    "ct-channel": (
        {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {
                "group_0": {**CT_GROUP, "weights": {**CT_GROUP["weights"], "strategy": "channel"}}
            },
        },
        fp8_per_channel,
    ),
    "fp8-blocks": (
        {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [48, 40]},
        fp8_blocks,
    ),
    "awq": (
        {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": 32, "zero_point": True},
        awq,
    ),
    "gptq-v1-act-order": (
        {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": False},
        gptq,
    ),
    "gptq-v2": (
        {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": 32,
            "desc_act": True,
            "sym": False,
            "checkpoint_format": "gptq_v2",
        },
        gptq_v2,
    ),
}


def write_folder(folder: Path, plain: Path, weights: dict, quant: dict | None = None) -> Path:
    """`plain`'s config (with `quant` as its quantization_config) and tokenizer, and `weights`."""
    folder.mkdir(parents=True, exist_ok=True)
    config = json.loads((plain / "config.json").read_text())
    if quant:
        config["quantization_config"] = quant
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in weights.items()}, folder / "model.safetensors")
    for name in TOKENIZER_FILES:
        if (plain / name).exists():
            shutil.copy(plain / name, folder / name)
    return folder


def quantized(plain: Path, quantize, seed: int = 0) -> tuple[dict, dict]:
    """(the quantized checkpoint's tensors, the plain weights they dequantize to)."""
    rng = torch.Generator().manual_seed(seed)
    stored, expected = {}, {}
    for name, tensor in load_file(plain / "model.safetensors").items():
        if not is_linear(name):
            stored[name] = expected[name] = tensor
            continue
        tensors, expected[name] = quantize(tensor.float(), rng)
        prefix = name.removesuffix("weight")
        stored.update({prefix + suffix: t for suffix, t in tensors.items()})
    return stored, expected


def greedy(folder: Path) -> list[list[int]]:
    with Engine(EngineConfig(model=str(folder), max_kv_tokens=512)) as engine:
        results = engine.generate([GenerateRequest(input_ids=p, sampling=GREEDY) for p in PROMPTS])
    return [r.output_ids for r in results]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_quantized_folder_loads_its_dequantized_weights(layout, plain, tmp_path, caplog):
    quant, quantize = LAYOUTS[layout]
    stored, expected = quantized(plain, quantize)
    folder = write_folder(tmp_path / "quantized", plain, stored, quant)
    with caplog.at_level(logging.WARNING, logger="flowlang.model"):
        weights = load_checkpoint(folder).weights
    assert sorted(weights) == sorted(expected)  # plain names only, every quant tensor consumed
    for name, tensor in expected.items():
        assert weights[name].dtype == torch.float32, name
        assert torch.equal(weights[name], tensor.float()), name
    said = [r.getMessage() for r in caplog.records if r.name == "flowlang.model"]
    if any(name.endswith(".input_scale") for name in stored):  # dropped, and said so once
        (message,) = said
        assert "input_scale" in message and "engine's dtype" in message
    else:
        assert not said
    reference = write_folder(tmp_path / "reference", plain, expected)
    assert greedy(folder) == greedy(reference)


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_bits_and_one_group(bits, plain, tmp_path):
    """8-bit GPTQ (4 values an int32), and group_size -1 without g_idx (one group per column)."""
    stored, expected = quantized(plain, lambda w, rng: gptq_v2(w, rng, bits=bits))
    quant = {"quant_method": "gptq", "bits": bits, "group_size": 48, "desc_act": True}
    quant["checkpoint_format"] = "gptq_v2"
    weights = load_checkpoint(write_folder(tmp_path / "act-order", plain, stored, quant)).weights
    assert all(torch.equal(weights[name], expected[name]) for name in expected)

    def one_group(w, rng):
        one = torch.zeros(w.shape[1], dtype=torch.long)
        q, z, s, ref = int_groups(w.t(), one, bits, (1, 2**bits - 1))  # v1: zeros from 1
        return {"qweight": pack(q, bits, 0), "qzeros": pack(z - 1, bits, 1), "scales": s}, ref

    stored, expected = quantized(plain, one_group)
    quant = {"quant_method": "gptq", "bits": bits, "group_size": -1, "desc_act": False}
    weights = load_checkpoint(write_folder(tmp_path / "one-group", plain, stored, quant)).weights
    assert all(torch.equal(weights[name], expected[name]) for name in expected)


REFUSED = [
    ({"quant_method": "hqq", "nbits": 4}, "'hqq'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
    ({"quant_method": "awq", "version": "gemv", "bits": 4, "group_size": 32}, "'gemv'"),
    ({"quant_method": "awq", "version": "exllama", "bits": 4, "group_size": 32}, "'exllama'"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 32}, "GPTQ with bits=3"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "'marlin'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, "'pack-quantized'"),
]


REFUSED_IDS = ["hqq", "bnb", "awq-gemv", "awq-exllama", "gptq-3bit", "gptq-marlin", "ct-int4"]


@pytest.mark.parametrize("quant, names", REFUSED, ids=REFUSED_IDS)
def test_unsupported_quantization_is_refused(quant, names, plain, tmp_path):
    stored, _ = quantized(plain, awq)
    with pytest.raises(CheckpointError, match=names) as refused:
        load_checkpoint(write_folder(tmp_path, plain, stored, quant))
    assert "awq (version gemm" in str(refused.value)  # and says what loads


def test_missing_or_leftover_quant_tensors_are_named(plain, tmp_path):
    quant, quantize = LAYOUTS["awq"]
    stored, _ = quantized(plain, quantize)
    missing = {k: v for k, v in stored.items() if k != "model.layers.1.mlp.up_proj.qzeros"}
    with pytest.raises(CheckpointError, match="'model.layers.1.mlp.up_proj.qzeros'"):
        load_checkpoint(write_folder(tmp_path / "missing", plain, missing, quant))
    orphan = stored | {"model.layers.0.mlp.extra.scales": torch.ones(2, 8, dtype=torch.half)}
    with pytest.raises(CheckpointError, match="'model.layers.0.mlp.extra.scales'"):
        load_checkpoint(write_folder(tmp_path / "orphan", plain, orphan, quant))

    quant, quantize = LAYOUTS["fp8-blocks"]
    stored, _ = quantized(plain, quantize)
    unscaled = dict(stored)
    del unscaled["model.layers.0.self_attn.o_proj.weight_scale_inv"]
    with pytest.raises(CheckpointError, match="'model.layers.0.self_attn.o_proj.weight_scale_inv'"):
        load_checkpoint(write_folder(tmp_path / "unscaled", plain, unscaled, quant))
    wrong = stored | {"model.layers.0.mlp.up_proj.weight_scale_inv": torch.ones(2, 2)}
    with pytest.raises(CheckpointError, match="up_proj.weight_scale_inv has shape"):
        load_checkpoint(write_folder(tmp_path / "wrong", plain, wrong, quant))


@pytest.mark.parametrize("strategy", ["group", "block"])
def test_compressed_tensors_group_and_block_scales(strategy, plain, tmp_path):
    """A scale per group of 16 input columns, or per [48, 40] block (edges cropped)."""
    block = (1, 16) if strategy == "group" else (48, 40)
    size = {"group_size": 16} if strategy == "group" else {"block_structure": list(block)}
    args = {**CT_GROUP["weights"], "strategy": strategy, **size}
    quant = {"quant_method": "compressed-tensors", "format": "float-quantized"}
    quant["config_groups"] = {"group_0": {**CT_GROUP, "weights": args}}

    def ct_blocks(w, rng):
        tensors, ref = fp8_blocks(w, rng, block)
        return {"weight": tensors["weight"], "weight_scale": tensors["weight_scale_inv"]}, ref

    stored, expected = quantized(plain, ct_blocks)
    weights = load_checkpoint(write_folder(tmp_path, plain, stored, quant)).weights
    assert sorted(weights) == sorted(expected)
    assert all(torch.equal(weights[name], expected[name]) for name in expected)
