"""One config-driven decoder for Llama, Mistral, Qwen2 and Qwen3, their mixture-of-experts kin (Mixtral,
Qwen2-MoE, Qwen3-MoE: a layer's MLP is then sieve/layers/moe.py), and Gemma 3 (sandwich norms around
attention and MLP, RMSNorm scaling by 1 + w (stored as 1 + w, so the norm kernels are the same), embeddings
times sqrt(hidden), GeGLU, query_pre_attn_scalar, and sliding-window layers with their own rotary base).

Reads like the reference model: embed -> N x (norm, attention, norm, MLP) -> norm, except that each
residual add happens inside the norm that follows it (`norm(x, residual)`, as in vLLM), so the two
fuse into one kernel. Batch layout and pages are the attention layer's business; this file sees a
flat token batch [T, hidden].

On CPU with sieve's native kernels (bf16, or float32 with quantized weights), the layer loop runs in C++ (`NativeDecoder`,
sieve/kernels/decoder.cpp): the same operations in the same order on the same kernels, without the
~15 Python-dispatched operations per layer that dominate a small model's step. This file stays the
reference, and the path for everything else (float32, CUDA, quantized KV caches).
"""

from __future__ import annotations

import torch
from torch import nn

from sieve.kernels import cpu_ops
from sieve.layers.activation import gelu_tanh_and_mul, silu_and_mul
from sieve.layers.attention import Attention, AttentionMetadata, KVCacheLayer
from sieve.layers.greedy_head import GreedyHead, GreedyHeadQ8
from sieve.layers.linear import Linear
from sieve.layers.mamba import Mamba2Mixer
from sieve.layers.mla import MultiHeadLatentAttention
from sieve.layers.moe import SparseMoE
from sieve.layers import pointwise_triton
from sieve.layers.norm import RMSNorm
from sieve.layers.rotary import RopeStep, RotaryEmbedding, apply_rotary
from sieve.models.arch import ModelArch


class DecoderLayer(nn.Module):
    def __init__(self, a: ModelArch, dtype: torch.dtype, index: int = 0, tp=None):
        super().__init__()
        self.a = a
        self.index = index
        self.tp = tp  # tensor parallelism: this layer holds a shard; o_proj's and down_proj's outputs are partial sums
        q_size, kv_size = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps, dtype)
        self.window = a.layer_windows[index] if a.layer_windows else None
        self.mla = MultiHeadLatentAttention(a, dtype) if a.is_mla else None  # DeepSeek: its own projections
        self.mamba = Mamba2Mixer(a, dtype) if index in a.mamba_layers else None  # a hybrid's state-space layer
        self.rotary_dim = int(a.head_dim * a.partial_rotary_factor)  # rotary on the first dims of each head only
        if self.mla is None and self.mamba is None:
            self.qkv_proj = Linear(a.hidden_size, [q_size, kv_size, kv_size], a.qkv_bias, dtype)
            self.o_proj = Linear(q_size, [a.hidden_size], a.o_bias, dtype)
            self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps, dtype) if a.qk_norm else None
            self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps, dtype) if a.qk_norm else None
            self.attn = Attention(a.num_heads, a.num_kv_heads, a.head_dim, a.attn_scale, self.window)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps, dtype)
        if a.gemma:  # Gemma's sandwich: the attention output is normed before the residual add, the MLP both sides
            self.pre_feedforward_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps, dtype)
            self.post_feedforward_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps, dtype)
        self.act = gelu_tanh_and_mul if a.hidden_act == "gelu_pytorch_tanh" else silu_and_mul
        self.moe = None
        if index in a.sparse_layers:  # a mixture-of-experts MLP
            self.moe = SparseMoE(a.hidden_size, a.moe_intermediate_size, a.num_experts, a.num_experts_per_tok, a.norm_topk_prob,
                                 a.shared_expert_intermediate_size, dtype, a.moe_scoring, a.moe_n_group, a.moe_topk_group,
                                 a.routed_scaling_factor, a.shared_expert_gated, a.moe_group_score)
        else:
            self.gate_up_proj = Linear(a.hidden_size, [a.intermediate_size] * 2, a.mlp_bias, dtype)
            self.down_proj = Linear(a.intermediate_size, [a.hidden_size], a.mlp_bias, dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, rope: RopeStep, cache: KVCacheLayer, meta: AttentionMetadata,
        lora=None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output (or the embeddings, with residual None); residual: the sum of
        everything before it. Returns (this layer's MLP output, the residual stream before it). `rope` and
        `meta` are this layer's: a sliding layer gets its own rotary tables and its window's view of the cache.
        `lora`: the step's rows grouped by adapter (sieve/lora LoRABatch), whose products each projection adds."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        adapt = None if lora is None else lora.at(self.index)  # the step's adapters at this layer's other sites
        if self.mamba is not None:
            attn = self.mamba(h, cache, meta, adapt)
        elif self.mla is not None:
            attn = self.mla(h, rope, cache, meta, adapt)
        else:
            attn = self._attention(h, rope, cache, meta, lora)
        if self.a.gemma:  # Gemma's sandwich: the attention output is normed before the residual add, the MLP both sides
            h, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(attn), residual)
            return self.post_feedforward_layernorm(self._mlp(h, lora)), residual
        h, residual = self.post_attention_layernorm(attn, residual)
        if self.moe is not None:
            return self.moe(h, adapt), residual
        return self._mlp(h, lora), residual

    def _mlp(self, h: torch.Tensor, lora) -> torch.Tensor:
        return self._reduce(self._proj("down_proj", self.act(self._proj("gate_up_proj", h, lora)), lora))

    def _proj(self, name: str, x: torch.Tensor, lora) -> torch.Tensor:
        """A projection, with the step's adapters' low-rank products added to their rows' outputs."""
        y = getattr(self, name)(x)
        return y if lora is None else lora.apply(self.index, name, x, y)

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The output of a row-parallel layer: every rank's partial sum added (no-op without tensor parallelism)."""
        return x if self.tp is None else self.tp.all_reduce(x)

    def _attention(self, h: torch.Tensor, rope: RopeStep, cache: KVCacheLayer, meta: AttentionMetadata, lora=None) -> torch.Tensor:
        a, T = self.a, h.shape[0]
        qkv = self._proj("qkv_proj", h, lora)  # [T, (H + 2 KVH) * D]: q | k | v
        q_size, kv_size = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        v = qkv[:, q_size + kv_size :].view(T, a.num_kv_heads, a.head_dim)
        if meta.query_taps:  # the queries before rotation (after Qwen3's norm), as the C++ loop hands them over
            q = qkv[:, :q_size].view(T, a.num_heads, a.head_dim)
            q = self.q_norm(q) if self.q_norm is not None else q
            for tap in meta.query_taps:
                tap.sink.add(self.index, q[tap.row: tap.row + tap.num_rows])
        if self.rotary_dim == a.head_dim and self.q_norm is None and self.attn.writes_fused(qkv, cache, meta):
            # CUDA, decode rows: rotary and the K/V write in one launch (sieve/layers/pointwise_triton.py)
            q = pointwise_triton.rotary_write_kv(qkv, rope.positions, rope.cos_table, rope.sin_table, cache.k, cache.v,
                                                 meta.slot_mapping, a.num_heads, a.num_kv_heads)
            return self._reduce(self._proj("o_proj", self.attn.decode_written(q, cache, meta).view(T, -1), lora))
        if self.rotary_dim < a.head_dim:  # partial rotary (Bamba): the rest of each head passes through
            qk = qkv[:, : q_size + kv_size].view(T, -1, a.head_dim)
            qk = torch.cat([apply_rotary(qk[..., : self.rotary_dim].contiguous(), rope), qk[..., self.rotary_dim :]], dim=-1)
            q, k = qk[:, : a.num_heads], qk[:, a.num_heads :]
        elif self.q_norm is None:  # rotate q and k together: one pass over [T, H + KVH, D]
            qk = apply_rotary(qkv[:, : q_size + kv_size].view(T, -1, a.head_dim), rope)
            q, k = qk[:, : a.num_heads], qk[:, a.num_heads :]
        else:
            q = self.q_norm(qkv[:, :q_size].view(T, a.num_heads, a.head_dim))
            k = self.k_norm(qkv[:, q_size : q_size + kv_size].view(T, a.num_kv_heads, a.head_dim))
            q, k = apply_rotary(q, rope), apply_rotary(k, rope)
        return self._reduce(self._proj("o_proj", self.attn(q, k, v, cache, meta).view(T, -1), lora))


class DecoderModel(nn.Module):
    # checkpoint sub-module name -> (our module, shard index)
    _stacked = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, a: ModelArch, dtype: torch.dtype, max_positions: int, tp=None):
        """With `tp` (a sieve.distributed TensorParallelGroup), `a` is one rank's shard (sieve.distributed.shard_arch):
        its heads and MLP channels, the whole vocabulary for the embedding, its slice of it for the head."""
        super().__init__()
        self.arch = a
        self.tp = tp
        # uninitialised: the checkpoint's table replaces it (drawing Gemma 3's 262k x 640 at random took 1.4 s)
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size, _weight=torch.empty(a.vocab_size, a.hidden_size, dtype=dtype),
                                         _freeze=True)
        # MLA rotates only the rope part of each head (qk_rope_head_dim)
        rot = a.qk_rope_head_dim if a.is_mla else int(a.head_dim * a.partial_rotary_factor)
        self.rotary = RotaryEmbedding(rot, max_positions, a.rope_theta, a.rope_scaling)
        # Gemma 3's sliding layers rotate with their own base and no scaling
        self.rotary_local = RotaryEmbedding(a.head_dim, max_positions, a.rope_local_theta, None) if a.rope_local_theta else None
        self.layers = nn.ModuleList(DecoderLayer(a, dtype, i, tp) for i in range(a.num_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps, dtype)
        self.lm_head = Linear(a.hidden_size, [tp.vocab_shard(a.vocab_size) if tp else a.vocab_size], False, dtype)
        self.kv_scales: dict[tuple[int, str], float] = {}  # (layer, "k" | "v") -> FP8 KV scale from the checkpoint
        self.quantized_embedding = None  # a checkpoint's quantized embedding table (GGUF), rows dequantized on lookup
        self.native = None  # NativeDecoder (sieve/kernels/decoder.cpp), built by `prepare` where it applies
        self.greedy_head = None  # GreedyHead (sieve/layers/greedy_head.py), likewise
        if a.tie_word_embeddings and tp is None:
            self.lm_head.weight = self.embed_tokens.weight  # one tensor: the embedding is the head (sharded: its rows)

    def embed(self, input_ids: torch.Tensor, lora=None) -> torch.Tensor:
        """`lora`: the step's adapters (sieve/lora LoRABatch), whose embed_tokens products are added (before Gemma's
        scale, which PEFT applies to them too)."""
        x = self._embed_rows(input_ids)
        if lora is not None:
            x = lora.embed(input_ids, x)
        if self.arch.gemma:  # times sqrt(hidden), rounded to the model dtype first (as Gemma does)
            x = x * torch.tensor(self.arch.hidden_size**0.5, dtype=x.dtype)
        return x

    def _embed_rows(self, input_ids: torch.Tensor) -> torch.Tensor:
        e, dtype = self.quantized_embedding, self.embed_tokens.weight.dtype
        if e is None:
            return self.embed_tokens(input_ids)
        ops = cpu_ops() if input_ids.device.type == "cpu" else None
        if ops is not None and getattr(e, "kind", None) == "int8" and e.scale.dim() == 2 and dtype in (torch.float32, torch.bfloat16):
            return ops.dequantize_rows_q8(e.q, e.scale, input_ids, dtype)  # one call; the same values as below
        return e.dequantize_rows(input_ids, dtype)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[KVCacheLayer], meta: AttentionMetadata,
        aux_layers: tuple[int, ...] = (),
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """input_ids, positions [T] -> final hidden states [T, hidden]. With `aux_layers` (0-based layer indices):
        (those, and [T, len(aux_layers) * hidden], the residual stream after each of those layers, side by side: the
        lower layers' features EAGLE-3's draft layer fuses with the last)."""
        if self.tp is not None:  # the driver tells the other ranks to run the same step on their shards
            if aux_layers:
                raise ValueError("the residual stream of inner layers is not gathered under tensor parallelism")
            self.tp.announce_forward(input_ids, positions, meta)
        x, residual = self.embed(input_ids, meta.lora), None
        aux = x.new_empty(x.shape[0], len(aux_layers) * x.shape[1]) if aux_layers else None
        lora_native = meta.lora.native() if meta.lora is not None else ([], [])
        native = self.native is not None and meta.write_kv and meta.capture is None and lora_native is not None
        if native and all(isinstance(c, KVCacheLayer) and c.native_loop for c in caches):
            out = self._forward_native(x, positions, caches, meta, list(aux_layers), aux, lora_native)
            return (out, aux) if aux_layers else out
        rope = self.rotary(positions, x.dtype)
        rope_local = self.rotary_local(positions, x.dtype) if self.rotary_local is not None else rope
        slots: dict[int, list[int]] = {}  # layer -> its places in `aux` (every one written, as the C++ loop does)
        for j, l in enumerate(aux_layers):
            slots.setdefault(l, []).append(j)
        for i, (layer, cache) in enumerate(zip(self.layers, caches)):
            if layer.window is None:
                x, residual = layer(x, residual, rope, cache, meta.for_layer(i), meta.lora)
            else:
                x, residual = layer(x, residual, rope_local, cache, meta.windows[layer.window], meta.lora)
            if i in slots:  # the stream after layer i: its output added to everything before it
                H = x.shape[1]
                for j in slots[i]:
                    torch.add(residual, x, out=aux[:, j * H: (j + 1) * H])
        out = self.norm(x, residual)[0]
        return (out, aux) if aux_layers else out

    def _forward_native(self, x, positions, caches, meta: AttentionMetadata, aux_layers: list[int] | None = None,
                        aux: torch.Tensor | None = None, lora: tuple[list, list[int]] = ([], [])) -> torch.Tensor:
        chunks = meta.prefills
        rows = [r for tap in meta.query_taps for r in range(tap.row, tap.row + tap.num_rows)]
        taps = x.new_empty(len(self.layers), len(rows), self.arch.num_heads * self.arch.head_dim) if rows else None
        out = self.native.forward(
            x, positions, meta.slot_mapping, meta.num_decodes, meta.decode_block_tables, meta.decode_context_lens,
            [c.start for c in chunks], [c.num_tokens for c in chunks], [c.context_len for c in chunks],
            [c.block_table for c in chunks], [c.k for c in caches], [c.v for c in caches],
            [c.k_scale for c in caches if c.k_scale is not None], [c.v_scale for c in caches if c.v_scale is not None],
            aux_layers or [], aux, rows, taps, lora[0], lora[1], self._layer_reads(caches, meta))
        first = 0
        for tap in meta.query_taps:  # each layer's tapped queries to their sinks, as the Python loop hands them over
            for layer in range(len(self.layers)):
                tap.sink.add(layer, taps[layer, first: first + tap.num_rows].view(tap.num_rows, self.arch.num_heads, -1))
            first += tap.num_rows
        return out

    @staticmethod
    def _layer_reads(caches, meta: AttentionMetadata):
        """With per-layer views (KV compression's per-layer budgets): what each layer reads in the C++ loop, its
        views' tables over its cache's `flat` pool (sieve/kernels/kernels.h LayerReads); None without them."""
        if not meta.layers:
            return None
        reads, views = cpu_ops().LayerReads(), [meta.layers[i] for i in range(len(caches))]
        reads.k, reads.v = [c.flat.k for c in caches], [c.flat.v for c in caches]
        if getattr(caches[0], "kind", None) == "int8":
            reads.k_scales, reads.v_scales = [c.flat.k_scale for c in caches], [c.flat.v_scale for c in caches]
        if meta.num_decodes:
            reads.decode_tables = [v.decode_block_tables for v in views]
            reads.decode_lens = [v.decode_context_lens for v in views]
        reads.chunk_tables = [c.block_table for v in views for c in v.prefills]
        reads.chunk_ctx = [c.context_len for v in views for c in v.prefills]
        return reads

    def compute_logits(self, hidden: torch.Tensor, lora=None) -> torch.Tensor:
        """hidden [B, hidden] -> float32 logits [B, vocab]. `lora`: the adapters that change the head, over these
        rows (sieve/lora LoRABatch.take)."""
        head = self.lm_head(hidden) if lora is None else lora.apply(-1, "lm_head", hidden, self.lm_head(hidden))
        if self.tp is None:
            logits = head.float()
        else:  # vocab-parallel head: each rank scores its slice, every rank gets them all
            self.tp.announce_logits(hidden, lora)
            logits = self.tp.gather_vocab(head.float(), self.arch.vocab_size)
        cap = self.arch.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def prepare(self, allow_two_layouts: bool, quantization: str | None = None, group_size: int = 128,
                quantize_lm_head: bool = False, greedy_head: bool = True) -> None:
        """After loading: let every linear layer pick its kernels (two weight layouts only if allowed).
        With `quantization`, the decoder layers' linears (and the LM head if asked; never the
        embedding or norms) take that weight format. `greedy_head`: greedy rows take their token from the head's
        int8 sketch where it applies (exact; sieve/layers/greedy_head.py)."""
        for name, m in self.named_modules():
            if isinstance(m, Linear):
                head = name == "lm_head"
                q = quantization if quantization and (not head or quantize_lm_head) else None
                if head and q == "awq":  # an AWQ checkpoint has no activation-aware scales for the head
                    q = "int4"
                if head and q and self.arch.tie_word_embeddings and self.tp is None and m.weight is not None and not m.is_prequantized:
                    m.weight = nn.Parameter(m.weight.detach().clone(), requires_grad=False)  # untie: the embedding stays
                m.prepare(allow_two_layouts, q, group_size)
        self.native = self._build_native()
        self.greedy_head = None
        if greedy_head and self.tp is None and GreedyHead.supported(self.lm_head, self.arch.final_logit_softcapping):
            self.greedy_head = GreedyHead(self.lm_head.weight)
        elif greedy_head and self.tp is None and GreedyHeadQ8.supported(self.lm_head, self.arch.final_logit_softcapping):
            self.greedy_head = GreedyHeadQ8(self.lm_head.native)

    def greedy_tokens(self, hidden: torch.Tensor, lora=None) -> torch.Tensor:
        """hidden [B, hidden] -> the first index of each row's max logit: what `compute_logits` then an argmax
        give, from the head's int8 sketch where it can answer (sieve/layers/greedy_head.py; not where an adapter
        changes the head)."""
        ids = self.greedy_head(hidden) if self.greedy_head is not None and lora is None else None
        return ids if ids is not None else self.compute_logits(hidden, lora).max(dim=-1).indices

    def _build_native(self):
        """The C++ layer loop, where every piece of a layer has a native kernel: CPU, bf16 activations, or
        float32 activations with quantized linears (a GGUF file's weights, kept as stored)."""
        a = self.arch
        first = self.layers[0].input_layernorm.weight if len(self.layers) else None
        if first is None or first.device.type != "cpu":  # asked before cpu_ops(): a GPU model builds no CPU kernels
            return None
        ops = cpu_ops()
        if (ops is None or not hasattr(ops, "NativeDecoder")
                or self.tp is not None  # the C++ loop has no collectives
                or first.dtype not in (torch.bfloat16, torch.float32) or a.is_moe  # the C++ loop has no expert routing,
                or a.gemma or a.has_sliding_layers or a.is_mla  # nor Gemma's norms and GeGLU, windows or latent attention,
                or a.has_recurrent_state):  # nor Mamba-2 layers
            return None
        linears = [(l.qkv_proj, l.o_proj, l.gate_up_proj, l.down_proj) for l in self.layers]
        if any(m.native is None or (first.dtype == torch.float32 and m.qkernel is None) for group in linears for m in group):
            return None
        native = ops.NativeDecoder(a.num_heads, a.num_kv_heads, a.head_dim, a.rms_norm_eps, a.head_dim**-0.5,
                                   self.rotary.cos, self.rotary.sin, self.norm.weight.detach())
        for layer, (qkv, o, gate_up, down) in zip(self.layers, linears):
            qn = layer.q_norm.weight.detach() if layer.q_norm is not None else None
            kn = layer.k_norm.weight.detach() if layer.k_norm is not None else None
            native.add_layer(layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(), qn, kn,
                             qkv.native, o.native, gate_up.native, down.native)
        return native

    # ---- weights ---------------------------------------------------------------------------
    def load_weight(self, name: str, tensor: torch.Tensor) -> bool:
        """Load one checkpoint tensor by its Hugging Face name. False if the model has no use for it."""
        if name.startswith("model."):
            name = name[len("model.") :]
        if self.arch.gemma and name.endswith("norm.weight") and isinstance(tensor, torch.Tensor):
            tensor = 1.0 + tensor.float()  # Gemma's RMSNorm scales by 1 + w, in float32; kept so the norm is the usual one
        if "rotary_emb" in name:
            return False
        if name == "final_layernorm.weight":  # Bamba's name for the final norm
            name = "norm.weight"
        if name == "embed_tokens.weight" and self.tp is not None and self.arch.tie_word_embeddings:
            from sieve.distributed.shard import vocab_rows

            self.lm_head.load("weight", vocab_rows(tensor, self.arch.vocab_size, self.tp))  # the head's rows, its own copy
        if name == "lm_head.weight":
            if self.arch.tie_word_embeddings:
                return False  # tied: the embedding is the head
            self.lm_head.load("weight", tensor)
            return True
        if name == "embed_tokens.weight" and not isinstance(tensor, torch.Tensor):  # quantized (GGUF): kept so
            self.quantized_embedding = tensor
            self.embed_tokens.weight = nn.Parameter(self.embed_tokens.weight.new_empty(0), requires_grad=False)
            if self.arch.tie_word_embeddings and self.tp is None:
                self.lm_head.weight = self.embed_tokens.weight  # untied from the empty table; the head takes the codes
                self.lm_head.load("weight", tensor)
            return True
        parts = name.split(".")
        if parts[0] == "layers" and parts[-1] in ("k_scale", "v_scale"):  # FP8 KV-cache scales (vLLM / ModelOpt names)
            self.kv_scales[(int(parts[1]), parts[-1][0])] = float(tensor.float().reshape(-1).max())
            return True
        if parts[0] == "layers" and self.layers[int(parts[1])].mamba is not None and parts[2] == "mamba":
            self.layers[int(parts[1])].mamba.load_weight(parts[3:], tensor)
            return True
        if parts[0] == "layers" and parts[2] in ("feed_forward", "pre_ff_layernorm"):  # Bamba's names for the MLP and its norm
            parts[2] = "mlp" if parts[2] == "feed_forward" else "post_attention_layernorm"
        if parts[0] == "layers" and self.layers[int(parts[1])].mla is not None and parts[2] == "self_attn":
            self.layers[int(parts[1])].mla.load_weight(parts[3:], tensor)
            return True
        if parts[0] == "layers" and self.layers[int(parts[1])].moe is not None and parts[2] in ("block_sparse_moe", "mlp"):
            self.layers[int(parts[1])].moe.load_weight(parts[3:], tensor)  # Mixtral's block_sparse_moe, Qwen's mlp
            return True
        if parts[0] == "layers":  # layers.{i}.{self_attn|mlp}.{proj}.{weight|bias} or layers.{i}.{norm}.weight
            layer = self.layers[int(parts[1])]
            sub, leaf = parts[-2], parts[-1]
            if sub in self._stacked:
                module, shard = self._stacked[sub]
                getattr(layer, module).load(leaf, tensor, shard)
                return True
            if sub in ("o_proj", "down_proj"):
                getattr(layer, sub).load(leaf, tensor)
                return True
            target = getattr(layer, sub, None)
        else:
            target = self.get_submodule(".".join(parts[:-1]))
            leaf = parts[-1]
        param = getattr(target, leaf, None) if target is not None else None
        if not isinstance(param, torch.Tensor):
            raise ValueError(f"checkpoint tensor {name!r} has no place in {self.arch.architecture}")
        if param.shape != tensor.shape:
            raise ValueError(f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)}, model {tuple(param.shape)}")
        param.data.copy_(tensor)
        return True
