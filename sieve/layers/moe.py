"""A mixture-of-experts MLP block (Mixtral, Qwen2-MoE, Qwen3-MoE): a router picks the top-k experts per token
(softmax over all experts in float32, then top-k, renormalised where the model does), tokens are grouped by
expert and each active expert runs one GEMM pair on its tokens, and the weighted outputs are summed per token
in expert order (so a token's result does not depend on which other tokens share the step). Qwen2-MoE adds a
shared expert on every token, scaled by a sigmoid gate. DeepSeek-V3 routes by sigmoid scores: a learned bias
shifts the choice (not the weights), only the `topk_group` groups of experts with the best two scores each are
eligible, and the chosen weights are renormalised and scaled by `routed_scaling_factor`; its shared experts
take every token ungated.

Experts are ordinary `Linear` layers, so they take every weight format a dense MLP takes. The router stays in the
model dtype (never quantized): it is tiny, and its choices are discrete.
"""

from __future__ import annotations

import torch
from torch import nn

from sieve.layers.activation import silu_and_mul
from sieve.layers.linear import Linear


class ExpertMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, dtype: torch.dtype):
        super().__init__()
        self.gate_up_proj = Linear(hidden, [inter, inter], False, dtype)
        self.down_proj = Linear(inter, [hidden], False, dtype)

    def forward(self, x: torch.Tensor, adapt=None, site: str = "") -> torch.Tensor:
        """`adapt` (sieve/lora LayerLoRA): the step's adapters, at sites `site`.gate_up_proj and `site`.down_proj."""
        if adapt is None:
            return self.down_proj(silu_and_mul(self.gate_up_proj(x)))
        h = silu_and_mul(adapt(site + ".gate_up_proj", x, self.gate_up_proj(x)))
        return adapt(site + ".down_proj", h, self.down_proj(h))


class SparseMoE(nn.Module):
    # checkpoint names of an expert's projections -> (our module, shard): Mixtral's w1/w3/w2, Qwen's names
    _proj = {"w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1), "w2": ("down_proj", None),
             "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", None)}

    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int, norm_topk_prob: bool, shared_inter: int,
                 dtype: torch.dtype, scoring: str = "softmax", n_group: int = 1, topk_group: int = 1, scaling: float = 1.0,
                 shared_gated: bool = True, group_score: str = ""):
        super().__init__()
        self.top_k, self.norm_topk_prob, self.num_experts = top_k, norm_topk_prob, num_experts
        self.scoring, self.n_group, self.topk_group, self.scaling = scoring, n_group, topk_group, scaling
        self.group_score = group_score  # "" (Mixtral, Qwen): plain softmax top-k; DeepSeek: "top2sum" (V3) or "max" (V2)
        self.router = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype), requires_grad=False)
        # DeepSeek-V3's score correction bias (float32, as it ships): a buffer, it chooses but never weighs
        self.register_buffer("score_bias", torch.zeros(num_experts) if scoring == "sigmoid" else None)
        self.experts = nn.ModuleList(ExpertMLP(hidden, inter, dtype) for _ in range(num_experts))
        self.shared_expert = ExpertMLP(hidden, shared_inter, dtype) if shared_inter else None
        gated = shared_inter and shared_gated
        self.shared_expert_gate = nn.Parameter(torch.empty(1, hidden, dtype=dtype), requires_grad=False) if gated else None
        self.last_active = 0  # experts that ran in the last call (for the benchmark)

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per token: the top-k expert ids [T, k] and their weights [T, k] (model dtype)."""
        if self.group_score:
            return self._route_grouped(h)
        probs = torch.softmax(nn.functional.linear(h, self.router).float(), dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights.to(h.dtype)

    def _route_grouped(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek, in float32. V3 (noaux_tc): sigmoid scores; bias-shifted scores choose within the groups whose
        two best sum highest. V2: softmax scores choose within the groups whose best is highest (group_limited_greedy)."""
        logits = nn.functional.linear(h.float(), self.router.float())
        scores = logits.sigmoid() if self.scoring == "sigmoid" else logits.softmax(dim=-1)
        choice = scores + self.score_bias if self.score_bias is not None else scores
        if self.n_group > 1:
            T, G = h.shape[0], self.n_group
            grouped = choice.view(T, G, -1)
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1) if self.group_score == "top2sum" else grouped.max(dim=-1).values
            keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(self.topk_group, dim=-1, sorted=False)[1], 1.0)
            choice = choice.masked_fill(~keep.bool().repeat_interleave(self.num_experts // G, dim=1), float("-inf"))
        ids = choice.topk(self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, (weights * self.scaling).to(h.dtype)

    def forward(self, h: torch.Tensor, adapt=None) -> torch.Tensor:
        """`adapt` (sieve/lora LayerLoRA): the step's adapters, which run on the shared expert (site shared_expert)."""
        ids, weights = self.route(h)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens, w = order // self.top_k, weights.reshape(-1)[order]
        out = torch.zeros_like(h)
        start, active = 0, 0
        for e, n in enumerate(counts):
            if n:
                rows = tokens[start:start + n]
                out.index_add_(0, rows, self.experts[e](h.index_select(0, rows)) * w[start:start + n, None])
                start += n
                active += 1
        self.last_active = active
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(nn.functional.linear(h, self.shared_expert_gate)) * self.shared_expert(h, adapt, "shared_expert")
        elif self.shared_expert is not None:
            out = out + self.shared_expert(h, adapt, "shared_expert")
        return out

    def load_weight(self, parts: list[str], tensor: torch.Tensor) -> None:
        """parts: a checkpoint name after the block ('gate.weight', 'experts.3.w1.weight', 'shared_expert.up_proj.weight',
        'shared_expert_gate.weight')."""
        head = parts[0]
        if head == "gate" and parts[1:] == ["weight"]:
            return self._copy(self.router, tensor, "gate")
        if head == "gate" and parts[1:] == ["e_score_correction_bias"] and self.score_bias is not None:
            return self._copy(self.score_bias, tensor.float(), "e_score_correction_bias")
        if head == "shared_experts":  # DeepSeek's name
            head, parts = "shared_expert", ["shared_expert", *parts[1:]]
        if head == "shared_expert_gate" and self.shared_expert_gate is not None:
            return self._copy(self.shared_expert_gate, tensor, head)
        if head == "experts" and len(parts) == 4 and parts[2] in self._proj:
            return self._load_proj(self.experts[int(parts[1])], parts[2], parts[3], tensor)
        if head == "shared_expert" and self.shared_expert is not None and len(parts) == 3 and parts[1] in self._proj:
            return self._load_proj(self.shared_expert, parts[1], parts[2], tensor)
        raise ValueError(f"checkpoint tensor {'.'.join(parts)!r} has no place in a mixture-of-experts block")

    def _load_proj(self, mlp: ExpertMLP, name: str, leaf: str, tensor: torch.Tensor) -> None:
        module, shard = self._proj[name]
        getattr(mlp, module).load(leaf, tensor, shard) if shard is not None else getattr(mlp, module).load(leaf, tensor)

    @staticmethod
    def _copy(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
        if param.shape != tensor.shape:
            raise ValueError(f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)}, model {tuple(param.shape)}")
        param.data.copy_(tensor)
