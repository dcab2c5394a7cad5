"""EAGLE (Li et al. 2024): a one-layer draft model that runs on the target's own features.

Where Medusa heads guess from one hidden state, EAGLE's draft layer is a small decoder layer with attention over
every earlier position: at position t it reads the target's last hidden state f_t (what the target's LM head
reads) and the embedding of the token x_{t+1} sampled from it, and predicts the next feature f_{t+1}; a draft
vocabulary head (the most written tokens, initialised from the target's LM-head rows, EAGLE-3's reduced vocabulary)
turns that into a guess of x_{t+2}. Drafting the next token feeds the layer its own predicted feature and guess.

- Training (`sieve distill --method eagle`, sieve/train/distill.py) runs the layer on whole sequences of the
  target's own answers, unrolled for `depth` drafting steps at once (EAGLE-3's "training-time test"): level s
  sees the target's features up to s positions back and its own predictions after them, exactly what draft
  token s + 1 sees when served. The mask that says so is `unroll_mask`.
- Serving (`EagleProposer`): the runner hands over the target's hidden state of every row it computed for a
  sequence (`needs_hidden = "all"`); positions committed since the last step enter the layer's own KV cache
  (dense, per sequence: one layer's K/V is small), then up to k tokens are drafted greedily, their entries
  overwritten next step. Committed tokens never change, so the cache never needs rolling back; a sequence
  recomputed after preemption skips positions already entered. Positions the target did not compute (a
  prefix-cache hit) have no features: the draft's context starts after them, which costs acceptance, never
  correctness.

Saved as a folder: `config.json` (sizes, the draft vocabulary, what training measured) and `eagle.safetensors`.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from sieve.layers.rotary import rotate_half_form
from sieve.sequence import Sequence
from sieve.spec_decode.folder import read_config, save_folder
from sieve.spec_decode.proposer import Draft, ProposerBase

WEIGHTS = "eagle.safetensors"
MAX_CATCH_UP = 64  # positions: a context left this far behind restarts at its last ones (the prompt is always whole)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, w.shape, w, eps)  # x * rsqrt(mean(x^2) + eps) * w, one operator rather than five


def unroll_mask(T: int, level: int, device=None) -> torch.Tensor:
    """Which keys level `level`'s query at position i attends, among the keys of levels 0..level laid end to end
    ([T, (level + 1) T], True: attend): the target-feature keys at positions <= i - level (the context that was
    committed when drafting started), and level r's key at position i - level + r for r = 1..level (the draft's own
    entries since, its own included)."""
    i = torch.arange(T, device=device)[:, None]
    j = torch.arange(T, device=device)[None, :]
    blocks = [j <= i - level] + [j == i - level + r for r in range(1, level + 1)]
    return torch.cat(blocks, dim=1)


class EagleLayer(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, intermediate_size: int,
                 rope_theta: float, rms_norm_eps: float, draft_vocab: list[int], aux_hidden_layers: list[int] = ()):
        super().__init__()
        H = hidden_size
        self.sizes = dict(hidden_size=H, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                          intermediate_size=intermediate_size, rope_theta=rope_theta, rms_norm_eps=rms_norm_eps,
                          aux_hidden_layers=list(aux_hidden_layers))
        self.hidden_size, self.aux_hidden_layers = H, tuple(aux_hidden_layers)
        self.nh, self.nkv, self.hd, self.eps = num_heads, num_kv_heads, head_dim, rms_norm_eps
        self.fc = nn.Linear(2 * H, H, bias=False)  # [embedding of x_{t+1}; feature f_t] -> the layer's input
        self.attn_norm = nn.Parameter(torch.ones(H))
        self.qkv = nn.Linear(H, (num_heads + 2 * num_kv_heads) * head_dim, bias=False)
        self.o = nn.Linear(num_heads * head_dim, H, bias=False)
        self.mlp_norm = nn.Parameter(torch.ones(H))
        self.gate_up = nn.Linear(H, 2 * intermediate_size, bias=False)
        self.down = nn.Linear(intermediate_size, H, bias=False)
        self.head = nn.Linear(H, len(draft_vocab), bias=False)
        self.register_buffer("draft_vocab", torch.tensor(draft_vocab, dtype=torch.int64), persistent=False)
        inv_freq = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._rope_tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        # The layer works on standardised inputs: the target's features divided per dimension by their RMS over the
        # training data (a few dimensions carry most of the magnitude), token embeddings by theirs (`calibrate`).
        self.register_buffer("feature_scale", torch.ones(H))
        self.register_buffer("embed_scale", torch.ones(1))
        # EAGLE-3's fused features: the target's residual stream after inner layers (standardised by `aux_scale`)
        # added to the last feature through `fuse`, which starts at zero (the plain EAGLE layer), so the layer's
        # input stays in the space of the features it predicts and feeds itself back while drafting.
        self.fuse = nn.Linear(len(self.aux_hidden_layers) * H, H, bias=False) if self.aux_hidden_layers else None
        if self.fuse is not None:
            self.register_buffer("aux_scale", torch.ones(len(self.aux_hidden_layers) * H))
            nn.init.zeros_(self.fuse.weight)
        with torch.no_grad():  # start as "the next feature is this one": the residual branches begin at zero
            self.fc.weight.zero_()
            self.fc.weight[:, H:].copy_(torch.eye(H))
            self.o.weight.mul_(0.1)
            self.down.weight.mul_(0.1)

    @classmethod
    def for_target(cls, arch, draft_vocab: list[int], aux_hidden_layers: list[int] = ()) -> "EagleLayer":
        """A layer shaped like one of the target's (its heads, KV heads and MLP width), on the target's rotary base."""
        return cls(arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.intermediate_size,
                   arch.rope_theta, arch.rms_norm_eps, draft_vocab, aux_hidden_layers)

    def _rotary(self, positions: torch.Tensor, until: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotation of positions [T] (each below `until`, a bound the host knows): [T, 1, D] tables of cos, and of
        sin signed for `_rope`, looked up in a table kept per device and dtype (two operators a pass where computing
        them took thirteen; the same bits, an element's angle and its cosine being computed alike in either)."""
        key = (self.inv_freq.device, dtype)
        table = self._rope_tables.get(key)
        if table is None or table[0].shape[0] < until:
            n = max(until, 2 * (table[0].shape[0] if table is not None else 256))
            freqs = torch.arange(n, dtype=torch.float32, device=self.inv_freq.device)[:, None] * self.inv_freq  # [n, D/2]
            cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
            table = self._rope_tables[key] = (torch.cat([cos, cos], -1)[:, None, :], torch.cat([-sin, sin], -1)[:, None, :])
        return table[0].index_select(0, positions), table[1].index_select(0, positions)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """[x1 cos - x2 sin, x2 cos + x1 sin] in the target's four-operator form, with the same bits (a product by -sin
        is minus the product by sin). (The target's `RotaryEmbedding` is not used whole: its table is fixed in size and
        float32, and on the CPU it rotates by a native kernel whose rounding training, which needs gradients, lacks.)"""
        return rotate_half_form(x, cos, signed_sin)

    @torch.no_grad()
    def calibrate(self, feats: torch.Tensor, table: torch.Tensor) -> None:
        """Fix the input scales from a sample of the target's features [N, H] (with fused layers [N, (1 + n) H], the
        last hidden state first) and its embedding table [V, H]."""
        rms = feats.float().pow(2).mean(0).sqrt().clamp_min(1e-3)
        self.feature_scale.copy_(rms[: self.hidden_size])
        if self.fuse is not None:
            self.aux_scale.copy_(rms[self.hidden_size:])
        self.embed_scale.fill_(1.0 / table.float().pow(2).mean().sqrt().clamp_min(1e-6).item())

    def scale_features(self, feats: torch.Tensor) -> torch.Tensor:
        """The target's features (its last hidden states, [..., H]: the first H of a row that carries fused layers
        too) in the layer's standardised space: what the layer predicts."""
        feats = feats[..., : self.hidden_size]
        return feats / self.feature_scale.to(feats.dtype)

    def input_features(self, feats: torch.Tensor) -> torch.Tensor:
        """The layer's input at committed positions: the standardised last feature, plus (EAGLE-3) the fused inner
        layers' ([..., (1 + n) H] rows as the runner hands them over)."""
        x = self.scale_features(feats)
        if self.fuse is not None:
            aux = feats[..., self.hidden_size:]
            x = x + self.fuse(aux / self.aux_scale.to(aux.dtype))
        return x

    def project(self, emb: torch.Tensor, feat: torch.Tensor, positions: torch.Tensor, until: int):
        """Rows [..., T, H] of token embeddings and standardised features (positions [T], each below `until`) -> the
        residual stream and rotated q, k, v [..., T, heads, D]."""
        lead = emb.shape[:-1]
        x = self.fc(torch.cat([emb * self.embed_scale.to(emb.dtype), feat], dim=-1))
        qk, v = self.qkv(_rms(x, self.attn_norm, self.eps)).split(
            [(self.nh + self.nkv) * self.hd, self.nkv * self.hd], dim=-1)
        cos, sin = self._rotary(positions, until, qk.dtype)
        q, k = self._rope(qk.view(*lead, self.nh + self.nkv, self.hd), cos, sin).split([self.nh, self.nkv], dim=-2)
        return x, q, k, v.view(*lead, self.nkv, self.hd)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """q [..., T, heads, D] over k, v [..., S, kv_heads, D] (mask [T, S], True: attend; None: all) ->
        [..., T, heads * D]."""
        rep = self.nh // self.nkv
        # On the CPU the operator takes the groups itself (the same bits as repeating k and v, two operators fewer). On
        # CUDA they stay repeated here: with a mask, grouped queries may send the operator to its unfused math form.
        inside = rep > 1 and q.device.type == "cpu"
        if rep > 1 and not inside:
            k, v = k.repeat_interleave(rep, dim=-2), v.repeat_interleave(rep, dim=-2)
        out = F.scaled_dot_product_attention(q.transpose(-3, -2), k.transpose(-3, -2), v.transpose(-3, -2), attn_mask=mask,
                                             enable_gqa=inside)
        return out.transpose(-3, -2).reshape(*q.shape[:-2], -1)

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The residual stream after attention -> the predicted next feature (standardised)."""
        x = x + self.o(attn)
        gate, up = self.gate_up(_rms(x, self.mlp_norm, self.eps)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)  # on the scale of the target's features, which the head was made for

    def logits(self, feat: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of a predicted (standardised) feature: the head reads the target's scale."""
        return self.head((feat * self.feature_scale.to(feat.dtype)).to(self.head.weight.dtype))

    def unrolled(self, emb: torch.Tensor, feats: torch.Tensor, depth: int) -> list[torch.Tensor]:
        """Training and measuring: one sequence's positions 0..T-1, `emb` [T, H] the embeddings of the tokens that
        follow them and `feats` [T, H] the target's features there, run for `depth` drafting steps at once. Level s's
        row i is draft token s + 1 of the state whose last committed position is i - s (valid for i >= s): it
        predicts the (standardised) feature at i + 1 and the token at i + 2.
        A batch of sequences [B, T, H], each padded at its end: a valid row of a sequence (i >= s, i below its length)
        reads only valid rows of its own, so the padding changes nothing but the padded rows."""
        T = emb.shape[-2]
        positions = torch.arange(T, device=emb.device)
        feats = self.input_features(feats)
        keys, values, outs = [], [], []
        for level in range(depth):
            # level s at i reads level s-1 at i-1
            f_in = feats if level == 0 else torch.cat([feats[..., :1, :], outs[-1][..., :-1, :]], dim=-2)
            x, q, k, v = self.project(emb, f_in, positions, T)
            keys.append(k)
            values.append(v)
            attn = self.attend(q, torch.cat(keys, dim=-3), torch.cat(values, dim=-3), unroll_mask(T, level, emb.device))
            outs.append(self.finish(x, attn))
        return outs

    def save(self, out: str | Path, meta: dict) -> None:
        save_folder(self, out, WEIGHTS, {"method": "eagle", **self.sizes, "draft_vocab": self.draft_vocab.tolist(), **meta})

    @classmethod
    def load(cls, path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> tuple["EagleLayer", dict]:
        from safetensors.torch import load_file

        path = Path(path)
        config = read_config(path, "eagle", "EAGLE layer", article="an ")
        sizes = ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "rope_theta", "rms_norm_eps")
        aux = config.get("aux_hidden_layers", [])
        if not isinstance(aux, list) or not all(isinstance(l, int) and not isinstance(l, bool) and l >= 0 for l in aux):
            raise ValueError(f"{path}: aux_hidden_layers must be a list of layer indices, got {aux!r}")
        try:
            layer = cls(*(config[k] for k in sizes), config["draft_vocab"], aux)
            layer.load_state_dict(load_file(str(path / WEIGHTS)))
        except Exception as e:  # missing sizes, a truncated or foreign weights file, other shapes
            raise ValueError(f"{path}: the EAGLE layer does not load ({type(e).__name__}: {e})") from e
        return layer.to(device=device, dtype=dtype).eval(), config


class SeqState:
    """One sequence's draft context: the layer's K/V for positions base .. base + n - 1 (entered from the target's
    features), and features at positions pend_start .. not entered yet."""

    __slots__ = ("base", "n", "k", "v", "pend_start", "pend", "pend_n")

    def __init__(self, start: int):
        self.base, self.n, self.k, self.v = start, 0, None, None
        self.pend_start, self.pend, self.pend_n = start, None, 0  # pend: a buffer, its first pend_n rows held

    @property
    def entered(self) -> int:
        return self.base + self.n

    def reserve(self, size: int, like: torch.Tensor) -> None:
        if self.k is None or self.k.shape[0] < size:
            cap = max(size, 2 * (self.k.shape[0] if self.k is not None else 16))
            k, v = like.new_empty((cap, *like.shape[1:])), like.new_empty((cap, *like.shape[1:]))
            if self.k is not None:
                k[: self.n], v[: self.n] = self.k[: self.n], self.v[: self.n]
            self.k, self.v = k, v

    def hold(self, start: int, rows: torch.Tensor) -> None:
        """Features at positions start .. start + len(rows) - 1 (start at most pend_start + pend_n), replacing any
        held from `start` on: written into a buffer that grows by doubling, not concatenated each step."""
        off = start - self.pend_start
        need = off + len(rows)
        if self.pend is None or self.pend.shape[0] < need:
            buf = rows.new_empty((max(need, 2 * (self.pend.shape[0] if self.pend is not None else 64)), rows.shape[1]))
            if self.pend is not None:
                buf[:off] = self.pend[:off]
            self.pend = buf
        self.pend[off:need] = rows
        self.pend_n = need


class EagleProposer(ProposerBase):
    """Drafts k tokens per sequence with the EAGLE layer: the committed positions' features enter each sequence's
    draft cache in one batched pass, then each further draft token is one batched pass of the layer."""

    free = False
    needs_hidden = "all"  # the target's hidden state of every row computed, not only the last
    aux_hidden_layers: tuple[int, ...] = ()  # and the residual stream after these layers (EAGLE-3 layers)

    def __init__(self, path: str, hidden_size: int, vocab_size: int, device: torch.device, dtype: torch.dtype, embed):
        self.layer, self.config = EagleLayer.load(path, device, dtype)
        if self.config["hidden_size"] != hidden_size:
            raise ValueError(f"the EAGLE layer at {path} was trained for hidden size {self.config['hidden_size']}, "
                             f"the target has {hidden_size}")
        if max(self.config["draft_vocab"]) >= vocab_size:
            raise ValueError(f"the EAGLE layer at {path} drafts token ids past the target's vocabulary ({vocab_size})")
        self.aux_hidden_layers = self.layer.aux_hidden_layers
        if device.type == "cpu" and dtype == torch.float32:
            self._int8_linears()
        self.embed, self.dtype, self.device = embed, dtype, device
        self.states: dict[Sequence, SeqState] = {}
        self._chain_masks: dict[tuple[int, int, int], torch.Tensor] = {}

    def _int8_linears(self) -> None:
        """On the CPU a draft pass is bound by the layer's bytes (float32: ~20 MB for SmolLM2's shape, a fifth of
        its Q4_1 target, 1.5 ms a pass on 2 Zen 3 cores): its linears run as int8 per-channel on the native kernels
        (a quarter of the bytes). A draft is only a guess, so rounding costs acceptance, never exactness."""
        from sieve.quant.formats import quantize_int8
        from sieve.quant.kernels import BlockedKernel, make_kernel

        for name in ("fc", "qkv", "o", "gate_up", "down", "head", "fuse"):
            lin = getattr(self.layer, name)
            if lin is None:
                continue
            kernel = make_kernel(quantize_int8(lin.weight.detach()), torch.float32)
            if isinstance(kernel, BlockedKernel):  # (no native kernels built here: the float32 layer stays)
                lin.forward = kernel

    @torch.inference_mode()  # (the buffers it writes may have been made in `propose`'s pass, which is one)
    def observe_hidden(self, seq: Sequence, start: int, rows: torch.Tensor) -> None:
        """The target's features at positions start .. start + len(rows) - 1 (some may be rows of drafts that
        will be rejected: only positions below the sequence's computed tokens are ever entered)."""
        st = self.states.get(seq)
        if st is None:
            st = self.states[seq] = SeqState(start)
        if start < st.entered:  # recomputed after preemption: those positions are in the cache already
            rows, start = rows[st.entered - start:], st.entered
            if not len(rows):
                return
        have = st.pend_start + st.pend_n
        if start > have:  # positions nobody computed (cannot follow entered ones): start the context again here
            st = self.states[seq] = SeqState(start)
            have = start
        if not st.pend_n:
            st.pend_start = start
        st.hold(start, rows)  # replaces what follows `start` (an earlier step's rejected rows)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int], branches: list[int] | None = None) -> list[Draft]:
        drafts = [Draft([]) for _ in seqs]
        batch = []  # (index, state, number of positions to enter)
        for i, seq in enumerate(seqs):
            st = self.states.get(seq)
            upto = seq.num_computed_tokens  # the positions whose tokens are committed
            if st is None or not st.pend_n or st.pend_start != st.entered or st.pend_start + st.pend_n < upto \
                    or upto <= st.entered:
                continue
            if st.n and upto - st.entered > MAX_CATCH_UP:
                # Not asked for a long while ("auto" chose k = 0; now a probe): restart the context at the last
                # MAX_CATCH_UP positions rather than enter every one missed, so what a probe costs stays bounded.
                start = upto - MAX_CATCH_UP
                fresh = SeqState(start)
                fresh.hold(start, st.pend[start - st.pend_start: st.pend_n])
                self.states[seq] = st = fresh
            batch.append((i, st, upto - st.entered))
        if not batch:
            return drafts
        layer = self.layer
        # 1. Enter every committed position since the last step: (feature at t, token t + 1) at position t.
        feats, toks, pos = [], [], []
        for i, st, m in batch:
            feats.append(st.pend[:m])
            toks += seqs[i].token_ids[st.entered + 1: st.entered + 1 + m]
            pos += range(st.entered, st.entered + m)
        feats = layer.input_features(torch.cat(feats).to(self.dtype))
        # The host's integers go over in one copy (on a GPU each copy from the host waits for the device's queue).
        lasts = list(itertools.accumulate(m for _, _, m in batch))
        ints = torch.tensor(toks + pos + [t - 1 for t in lasts], device=self.device)
        emb = self.embed(ints[: len(toks)]).to(self.dtype)
        x, q, k, v = layer.project(emb, feats, ints[len(toks): 2 * len(toks)], max(pos) + 1)
        attn, row, k_max = [], 0, max(ks[i] for i, _, _ in batch)
        for i, st, m in batch:
            st.reserve(st.n + m + k_max, k)
            st.k[st.n: st.n + m], st.v[st.n: st.n + m] = k[row: row + m], v[row: row + m]
            S = st.n + m
            mask = None
            if m > 1:  # causal among the new positions
                mask = torch.arange(S, device=self.device)[None, :] <= torch.arange(st.n, S, device=self.device)[:, None]
            attn.append(layer.attend(q[row: row + m], st.k[:S], st.v[:S], mask))
            st.n, st.pend_start, st.pend_n = S, st.base + S, 0
            row += m
        out = layer.finish(x, torch.cat(attn))
        # Each sequence's prediction of the feature after its last committed position.
        g = out[-1:] if len(batch) == 1 else out.index_select(0, ints[2 * len(toks):])
        width = [min(branches[i], len(layer.draft_vocab)) if branches else 1 for i, _, _ in batch]
        self._draft(ks, batch, g, width, k_max, k[:1], drafts)
        return drafts

    def _draft(self, ks, batch, g, width, k_max, like, drafts) -> None:
        """Draft up to ks[i] tokens greedily for each sequence in `batch` from `g`, its predicted next feature; with
        width[a] > 1, a draft tree that branches at its root: sequence a's width[a] likeliest first tokens, each
        continued greedily as its own chain. (Keeping instead the likeliest paths by cumulative probability, EAGLE-2's
        beam, accepted less on open chat: this layer's confidence is a poor guide, and the first token is where the
        chains must differ.) Chain c's own entries in the draft cache sit at n + c * k_max + j, after the committed
        ones; one masked pass per sequence attends each chain to those and its own."""
        layer, dev, W = self.layer, self.device, max(width)
        logits = layer.logits(g)
        if W > 1:
            for _, st, _ in batch:
                st.reserve(st.n + k_max * W, like)
                # Zeros where no chain has written yet: a masked-out key still enters the product, and the buffer's
                # uninitialised memory may hold NaN, which no mask takes back out.
                st.k[st.n: st.n + k_max * W] = 0
                st.v[st.n: st.n + k_max * W] = 0
            top = logits.topk(W, dim=-1).indices
            rows = [(a, c) for a in range(len(batch)) for c in range(width[a])]  # (sequence, chain)
            if all(w == W for w in width):  # every sequence branches fully (the usual case): no index to copy over
                d, g = top.reshape(-1), g.repeat_interleave(W, dim=0)
            else:
                idx = torch.tensor([[a for a, _ in rows], [c for _, c in rows]], device=dev)
                d, g = top[idx[0], idx[1]], g.index_select(0, idx[0])
        else:
            rows, d = [(a, 0) for a in range(len(batch))], logits.argmax(dim=-1)
        # Each row's position before its first draft; draft step j enters position base + j.
        base = torch.tensor([batch[a][1].entered for a, _ in rows], device=dev)
        until = max(st.entered for _, st, _ in batch) + 1  # above every row's position at draft step 0
        # Each draft step's (chains, their tokens' draft-vocabulary indices), read back to the host once at the end:
        # which chains go on depends only on ks, so no step waits on the device (a GPU's launches queue ahead).
        steps, chains_of = [], {r: [] for r in rows}  # token ids of each (sequence, chain)
        for j in range(k_max):
            steps.append((rows, d))
            live = [n for n, (a, _) in enumerate(rows) if ks[batch[a][0]] > j + 1]
            if not live:
                break
            # The next token of every chain still short of its sequence's k: the layer on the chain's own feature and guess.
            if len(live) < len(rows):
                sel = torch.tensor(live, device=dev)
                rows, g, d, base = [rows[n] for n in live], g.index_select(0, sel), d.index_select(0, sel), base.index_select(0, sel)
            x, q, k, v = layer.project(self.embed(layer.draft_vocab[d]).to(self.dtype), g, base + j, until + j)
            if W == 1:  # one chain a sequence: its committed entries and its own are contiguous, no mask
                attn = []
                for n, (a, _) in enumerate(rows):
                    st = batch[a][1]
                    S = st.n + j + 1
                    st.k[S - 1], st.v[S - 1] = k[n], v[n]
                    attn.append(layer.attend(q[n: n + 1], st.k[:S], st.v[:S], None))
                attn = torch.cat(attn)
            else:
                attn = self._attend_chains(batch, rows, q, k, v, k_max, j)
            g = layer.finish(x, attn)
            d = layer.logits(g).argmax(dim=-1)
        tokens = iter(layer.draft_vocab[torch.cat([d for _, d in steps])].tolist() if steps else ())
        for rows, _ in steps:
            for r in rows:
                chains_of[r].append(next(tokens))
        for a, (i, _, _) in enumerate(batch):
            chains = [chains_of[(a, c)][: ks[i]] for c in range(width[a])]
            drafts[i] = Draft(chains[0], alternatives=chains[1:])

    def _attend_chains(self, batch, rows, q, k, v, k_max: int, j: int) -> torch.Tensor:
        """Draft step j of chains laid out as `_draft` says: each row's K/V entered at its chain's slot, then one masked
        pass per sequence over its committed entries and each chain's own. A sequence's chains are rows lo .. hi - 1,
        chains 0 .. w - 1 in order (all of them go on or none: how far depends on the sequence's k), so their slots
        are every k_max-th entry from n + j, and the rows, slots and mask are slices, not indices copied from the host."""
        attn, lo = [], 0
        while lo < len(rows):
            a, hi = rows[lo][0], lo
            while hi < len(rows) and rows[hi][0] == a:
                hi += 1
            st, w = batch[a][1], hi - lo
            S = st.n + (w - 1) * k_max + j + 1
            st.k[st.n + j: S: k_max], st.v[st.n + j: S: k_max] = k[lo:hi], v[lo:hi]
            mask = torch.cat([torch.ones(w, st.n, dtype=torch.bool, device=self.device), self._chain_mask(w, k_max, j)], dim=1)
            attn.append(self.layer.attend(q[lo:hi], st.k[:S], st.v[:S], mask))
            lo = hi
        return torch.cat(attn)

    def _chain_mask(self, w: int, k_max: int, j: int) -> torch.Tensor:
        """[w, (w - 1) k_max + j + 1]: chain c's row attends to its own entries c k_max .. c k_max + j (kept per shape)."""
        key = (w, k_max, j)
        mask = self._chain_masks.get(key)
        if mask is None:
            col = torch.arange((w - 1) * k_max + j + 1, device=self.device)
            mask = self._chain_masks[key] = (col[None, :] // k_max == torch.arange(w, device=self.device)[:, None]) & (col[None, :] % k_max <= j)
        return mask

    def finish(self, seq: Sequence) -> None:
        self.states.pop(seq, None)

