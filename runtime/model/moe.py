"""Feed-forward blocks: the dense gated SiLU MLP and a top-k mixture of experts (Mixtral,
Qwen3-MoE), loaded from any of the checkpoint layouts transformers reads.

The MoE is the plain batched form, correct before fast: route every token, then one pair of
matmuls per expert over the tokens that chose it, weighted and summed back (index_add).
Numerics follow transformers: router softmax in fp32, top-k, renormalized when the family does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from runtime.model.arch import ModelArch
from runtime.model.gguf_blocks import Blocks, linear_blocks
from runtime.model.linear import Linear

Getter = Callable[[str], torch.Tensor]
ActMul = Callable[[torch.Tensor], torch.Tensor]


class GatedMLP:
    """down(act(gate(x)) * up(x)) with gate/up fused into one matmul; `act_mul` takes the
    fused (tokens, 2 * intermediate) output (one kernel on CUDA, runtime/model/pointwise.py)."""

    def __init__(self, gate_up: Linear, down: Linear, act_mul: ActMul) -> None:
        self.gate_up, self.down = gate_up, down  # (2*intermediate, hidden), (hidden, intermediate)
        self.act_mul = act_mul

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act_mul(self.gate_up(x)))

    @property
    def num_params(self) -> int:
        return self.gate_up.num_params + self.down.num_params


class SparseMoE:
    """Top-k routed experts; x (num_tokens, hidden) -> (num_tokens, hidden)."""

    def __init__(
        self,
        router: torch.Tensor,  # (num_experts, hidden)
        gate_up: torch.Tensor,  # (num_experts, 2*intermediate, hidden)
        down: torch.Tensor,  # (num_experts, hidden, intermediate)
        top_k: int,
        renormalize: bool,
    ) -> None:
        self.router, self.gate_up, self.down = router, gate_up, down
        self.top_k, self.renormalize = top_k, renormalize

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(F.linear(x, self.router).float(), dim=-1)  # (num_tokens, num_experts)
        weights, experts = probs.topk(self.top_k, dim=-1)  # (num_tokens, top_k)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for expert in experts.unique().tolist():
            token_idx, choice = torch.where(experts == expert)
            gate, up = F.linear(x[token_idx], self.gate_up[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down[expert])  # (num_routed, hidden)
            out.index_add_(0, token_idx, y * weights[token_idx, choice, None])
        return out

    @property
    def num_params(self) -> int:
        return self.router.numel() + self.gate_up.numel() + self.down.numel()


def load_feed_forward(
    arch: ModelArch,
    layer: int,
    get: Getter,
    names: set[str],
    pack: bool,
    act_mul: ActMul,
    blocks: dict[str, Blocks] | None = None,
) -> GatedMLP | SparseMoE:
    """Layer `layer`'s feed-forward block from its checkpoint tensors; `blocks`: GGUF block
    bytes by checkpoint name (gguf_blocks.py) for the dense MLP's decode rows."""
    p = f"model.layers.{layer}."
    if not arch.moe_layers[layer]:
        blocks = blocks or {}
        if p + "mlp.gate_up_proj.weight" in names:  # Phi-3 stores it fused
            gate_up = get(p + "mlp.gate_up_proj.weight")
            gate_up_blocks = None
        else:
            parts = [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
            gate_up = torch.cat([get(name) for name in parts])
            gate_up_blocks = linear_blocks(blocks, parts)
        down_name = p + "mlp.down_proj.weight"
        down = Linear(get(down_name), None, pack, blocks=linear_blocks(blocks, [down_name]))
        return GatedMLP(Linear(gate_up, None, pack, blocks=gate_up_blocks), down, act_mul)
    block = p + ("block_sparse_moe." if p + "block_sparse_moe.gate.weight" in names else "mlp.")
    gate_up, down = _expert_weights(arch.num_experts, block + "experts.", get, names)
    return SparseMoE(
        get(block + "gate.weight"), gate_up, down, arch.num_experts_per_tok, arch.norm_topk_prob
    )


def _expert_weights(
    num_experts: int, prefix: str, get: Getter, names: set[str]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked (num_experts, 2*inter, hidden) and (num_experts, hidden, inter) from the fused
    layout (transformers 5), per-expert gate/up/down (Qwen3-MoE) or w1/w3/w2 (Mixtral)."""
    if prefix + "gate_up_proj" in names:
        return get(prefix + "gate_up_proj"), get(prefix + "down_proj")
    gate, up, down = (
        ("w1", "w3", "w2")
        if prefix + "0.w1.weight" in names
        else ("gate_proj", "up_proj", "down_proj")
    )
    gate_up = torch.stack(
        [
            torch.cat([get(f"{prefix}{e}.{gate}.weight"), get(f"{prefix}{e}.{up}.weight")])
            for e in range(num_experts)
        ]
    )
    return gate_up, torch.stack([get(f"{prefix}{e}.{down}.weight") for e in range(num_experts)])
