"""Medusa heads (Cai et al. 2024): K small heads on the target's last hidden state, head k guessing the token
k + 1 places after the one the target samples from that state. One head is a residual block h + SiLU(W h + b);
every head then projects onto a draft vocabulary (the tokens the target actually writes most, EAGLE-3's trick,
so a draft costs a fraction of the target's LM head), initialised from the target's own LM-head rows.

The heads are trained by `sieve distill --method medusa` on the target's own generations (sieve/train/distill.py)
and saved as a folder: `config.json` (sizes, the draft vocabulary, the target, what training measured) and
`heads.safetensors`.

The proposer drafts greedily from the hidden state the engine hands it after each step (`observe_hidden`): the
state of the position that produced each sequence's last token, so no extra target pass is needed.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from sieve.sequence import Sequence
from sieve.spec_decode.folder import read_config, save_folder
from sieve.spec_decode.proposer import Draft, ProposerBase

WEIGHTS = "heads.safetensors"


class MedusaHeads(nn.Module):
    """Medusa heads, or with `sequential` Hydra heads (Ankner et al. 2024): head k also sees the embedding of the
    token before the one it guesses (the target's sampled token for head 1, head k - 1's guess after it), through a
    running state s_k = s_{k-1} + SiLU(W_k [s_{k-1}; e(y_k)] + b_k), s_0 = h. Knowing the token in between is most
    of what a head lacks."""

    def __init__(self, hidden_size: int, num_heads: int, draft_vocab: list[int], sequential: bool = False):
        super().__init__()
        self.hidden_size, self.num_heads, self.sequential = hidden_size, num_heads, sequential
        width = 2 * hidden_size if sequential else hidden_size
        self.blocks = nn.ModuleList(nn.Linear(width, hidden_size) for _ in range(num_heads))
        self.proj = nn.Linear(hidden_size, len(draft_vocab), bias=False)
        self.register_buffer("draft_vocab", torch.tensor(draft_vocab, dtype=torch.int64), persistent=False)
        for b in self.blocks:  # a head starts as the identity: it guesses what the target's head guesses
            nn.init.zeros_(b.weight)
            nn.init.zeros_(b.bias)

    def forward(self, hidden: torch.Tensor, inputs: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [B, H] (and, sequential, the embeddings of the tokens each head follows [B, K, H]: teacher
        forcing) -> logits over the draft vocabulary [B, K, V']."""
        if not self.sequential:
            return self.proj(self._independent_states(hidden, self.num_heads))
        states, s = [], hidden
        for k, b in enumerate(self.blocks):
            s = s + nn.functional.silu(b(torch.cat([s, inputs[:, k]], dim=-1)))
            states.append(s)
        return self.proj(torch.stack(states, dim=1))

    def _independent_states(self, hidden: torch.Tensor, k: int) -> torch.Tensor:
        """Medusa-1: each of the first k heads' state from the hidden state alone [B, k, H]."""
        return torch.stack([hidden + nn.functional.silu(b(hidden)) for b in self.blocks[:k]], dim=1)

    @torch.inference_mode()
    def draft(self, hidden: torch.Tensor, k: int, last_emb: torch.Tensor | None = None, embed=None) -> torch.Tensor:
        """The first k heads' greedy guesses, as target token ids [B, k]. Sequential heads need the embedding of
        each sequence's last token (`last_emb` [B, H]) and `embed` for their own guesses."""
        low = self.proj.weight.dtype  # the projection may be kept narrower than the heads (see MedusaProposer)
        if not self.sequential:
            return self.draft_vocab[self.proj(self._independent_states(hidden, k).to(low)).argmax(dim=-1)]
        s, e, guesses = hidden, last_emb, []
        for b in self.blocks[:k]:
            s = s + nn.functional.silu(b(torch.cat([s, e], dim=-1)))
            g = self.draft_vocab[self.proj(s.to(low)).argmax(dim=-1)]
            guesses.append(g)
            e = embed(g).to(s.dtype)
        return torch.stack(guesses, dim=1)

    @torch.inference_mode()
    def draft_tree(self, hidden: torch.Tensor, k: int, width: int, last_emb: torch.Tensor | None = None,
                   embed=None) -> torch.Tensor:
        """A draft tree that branches at its root, as target token ids [B, width, k]: the first head's `width`
        likeliest tokens, each followed by the next heads' greedy guesses (independent heads guess the same after
        every first token; sequential heads read each chain's own)."""
        low = self.proj.weight.dtype
        B = hidden.shape[0]
        if not self.sequential:
            logits = self.proj(self._independent_states(hidden, k).to(low))  # [B, k, V']
            first = logits[:, 0].topk(width, dim=-1).indices  # [B, width]
            rest = logits[:, 1:].argmax(dim=-1)[:, None, :].expand(B, width, k - 1)
            return self.draft_vocab[torch.cat([first[:, :, None], rest], dim=2)]
        s = hidden + nn.functional.silu(self.blocks[0](torch.cat([hidden, last_emb], dim=-1)))
        first = self.draft_vocab[self.proj(s.to(low)).topk(width, dim=-1).indices].reshape(-1)  # [B * width]
        s, guesses = s.repeat_interleave(width, dim=0), [first]
        e = embed(first).to(s.dtype)
        for b in self.blocks[1:k]:
            s = s + nn.functional.silu(b(torch.cat([s, e], dim=-1)))
            g = self.draft_vocab[self.proj(s.to(low)).argmax(dim=-1)]
            guesses.append(g)
            e = embed(g).to(s.dtype)
        return torch.stack(guesses, dim=1).view(B, width, k)

    def save(self, out: str | Path, meta: dict) -> None:
        save_folder(self, out, WEIGHTS, {"method": "medusa", "hidden_size": self.hidden_size, "num_heads": self.num_heads,
                                         "sequential": self.sequential, "draft_vocab": self.draft_vocab.tolist(), **meta})

    @classmethod
    def load(cls, path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> tuple["MedusaHeads", dict]:
        from safetensors.torch import load_file

        path = Path(path)
        config = read_config(path, "medusa", "Medusa heads")
        heads = cls(config["hidden_size"], config["num_heads"], config["draft_vocab"], config.get("sequential", False))
        heads.load_state_dict(load_file(str(path / WEIGHTS)))
        return heads.to(device=device, dtype=dtype).eval(), config


class MedusaProposer(ProposerBase):
    """Drafts k tokens per sequence from its last hidden state: one batched pass of the heads per step."""

    free = False  # drafting costs a little compute: the depth controller decides before asking
    needs_hidden = "last"

    def __init__(self, path: str, hidden_size: int, vocab_size: int, device: torch.device, dtype: torch.dtype, embed=None):
        self.heads, self.config = MedusaHeads.load(path, device, dtype)
        self.embed = embed  # the target's input embedding (token ids -> [N, H]): sequential heads read it
        if self.config["hidden_size"] != hidden_size:
            raise ValueError(f"Medusa heads at {path} were trained for hidden size {self.config['hidden_size']}, "
                             f"the target has {hidden_size}")
        if max(self.config["draft_vocab"]) >= vocab_size:
            raise ValueError(f"Medusa heads at {path} draft token ids past the target's vocabulary ({vocab_size})")
        self.max_k = self.config["num_heads"]
        if self.heads.proj.weight.device.type == "cpu" and dtype == torch.float32:
            # The projection is most of a draft's bytes (V' x H, read once per head): bfloat16 halves them. A draft
            # is only a guess (verification keeps the output exact), so its rounding costs nothing but acceptance.
            self.heads.proj.to(torch.bfloat16)
        self.dtype = dtype
        self.hidden: dict[Sequence, torch.Tensor] = {}  # seq -> hidden state that produced its last token

    def observe_hidden(self, seq: Sequence, start: int, rows: torch.Tensor) -> None:
        self.hidden[seq] = rows[-1]

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int], branches: list[int] | None = None) -> list[Draft]:
        have = [i for i, s in enumerate(seqs) if s in self.hidden]
        drafts = [Draft([]) for _ in seqs]
        if not have:
            return drafts
        k = min(max(ks[i] for i in have), self.max_k)
        states = torch.stack([self.hidden[seqs[i]] for i in have]).to(self.dtype)
        last = None
        if self.heads.sequential:
            last = self.embed(torch.tensor([seqs[i].token_ids[-1] for i in have], device=states.device)).to(self.dtype)
        width = min(max(branches[i] for i in have), len(self.config["draft_vocab"])) if branches else 1
        if width > 1:  # a draft tree: each sequence takes its first branches[i] chains
            trees = self.heads.draft_tree(states, k, width, last, self.embed).tolist()
            for i, t in zip(have, trees):
                chains = [c[: ks[i]] for c in t[: branches[i]]]
                drafts[i] = Draft(chains[0], alternatives=chains[1:])
            return drafts
        guesses = self.heads.draft(states, k, last, self.embed).tolist()
        for i, g in zip(have, guesses):
            drafts[i] = Draft(g[: ks[i]])
        return drafts

    def finish(self, seq: Sequence) -> None:
        self.hidden.pop(seq, None)
