"""A Mamba-2 mixer (the state-space layers of Bamba-style hybrids), over a per-sequence recurrent state.

Where an attention layer keeps K/V per token, a Mamba-2 layer keeps per sequence a fixed-size state: the last
d_conv - 1 inputs of its causal depthwise convolution, and the SSM state h (heads x head_dim x d_state). A token:
  z, xBC, dt = in_proj(u);  xBC = silu(conv1d(last inputs, xBC));  x, B, C = split(xBC)
  dt = clamp(softplus(dt + dt_bias));  h = exp(dt A) h + dt x B^T;  y = h C + D x
  out = out_proj(rmsnorm_grouped(y * silu(z)))
Decode rows take one such step (batched over sequences). A prefill chunk of n tokens runs the same recurrence
in its closed form (the SSD "quadratic" form within a chunk): with L_t the running sum of dt A,
  y_t = C_t . (e^{L_t} h_0) + sum_{s<=t} e^{L_t - L_s} (C_t . B_s) dt_s x_s + D x_t,
  h_n = e^{L_n} h_0 + sum_s e^{L_n - L_s} dt_s x_s B_s^T,
in sub-chunks of at most `SUB_CHUNK` tokens, so prompts prefill in chunks (as the scheduler cuts them) and a
sequence continues from whatever state the previous chunk left. States are float32 and live in slots the block
manager hands each running sequence (`RecurrentState`, owned by the model runner).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from sieve.layers.linear import Linear

SUB_CHUNK = 128


@dataclass
class RecurrentMetadata:
    """Which state slot each row continues: decode rows 0..len(decode_slots)-1, then prefill chunks (first row,
    tokens, slot)."""

    decode_slots: torch.Tensor | None = None  # [num_decodes] int64
    prefills: list[tuple[int, int, int]] = field(default_factory=list)


class RecurrentState:
    """One Mamba-2 layer's states, one slot per running sequence (float32)."""

    def __init__(self, slots: int, conv_dim: int, d_conv: int, heads: int, head_dim: int, d_state: int, device: torch.device):
        self.conv = torch.zeros(slots, conv_dim, d_conv - 1, device=device)
        self.ssm = torch.zeros(slots, heads, head_dim, d_state, device=device)

    def reset(self, slots: torch.Tensor) -> None:
        self.conv.index_fill_(0, slots, 0.0)
        self.ssm.index_fill_(0, slots, 0.0)

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.conv[dst] = self.conv[src]
        self.ssm[dst] = self.ssm[src]


class Mamba2Mixer(nn.Module):
    def __init__(self, a, dtype: torch.dtype):
        super().__init__()
        self.I, self.H, self.P, self.G, self.N = a.mamba_intermediate, a.mamba_n_heads, a.mamba_d_head, a.mamba_n_groups, a.mamba_d_state
        self.conv_dim, self.d_conv = a.mamba_conv_dim, a.mamba_d_conv
        self.eps, self.dt_limit = a.rms_norm_eps, a.time_step_limit
        self.in_proj = Linear(a.hidden_size, [self.I + self.conv_dim + self.H], a.mamba_proj_bias, dtype)
        self.conv_weight = nn.Parameter(torch.zeros(self.conv_dim, 1, self.d_conv, dtype=dtype), requires_grad=False)
        self.conv_bias = nn.Parameter(torch.zeros(self.conv_dim, dtype=dtype), requires_grad=False) if a.mamba_conv_bias else None
        self.dt_bias = nn.Parameter(torch.zeros(self.H, dtype=dtype), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(self.H, dtype=dtype), requires_grad=False)
        self.D = nn.Parameter(torch.zeros(self.H, dtype=dtype), requires_grad=False)
        self.norm_weight = nn.Parameter(torch.ones(self.I, dtype=dtype), requires_grad=False)
        self.out_proj = Linear(self.I, [a.hidden_size], a.mamba_proj_bias, dtype)

    def forward(self, u: torch.Tensor, state: RecurrentState, meta, adapt=None) -> torch.Tensor:
        """u [T, hidden] -> [T, hidden]; reads and advances the states of the slots `meta.recurrent` names. `adapt`
        (sieve/lora LayerLoRA): the step's adapters, at sites mamba.in_proj and mamba.out_proj."""
        rec: RecurrentMetadata = meta.recurrent
        adapt = adapt or (lambda site, x, y: y)
        proj = adapt("mamba.in_proj", u, self.in_proj(u)).float()
        z, xbc, dt = proj.split([self.I, self.conv_dim, self.H], dim=-1)
        dt = F.softplus(dt + self.dt_bias.float()).clamp(self.dt_limit[0], self.dt_limit[1])
        A = -torch.exp(self.A_log.float())
        y = torch.empty(u.shape[0], self.H, self.P, device=u.device)
        nd = 0 if rec.decode_slots is None else rec.decode_slots.numel()
        if nd:
            y[:nd] = self._decode(xbc[:nd], dt[:nd], A, state, rec.decode_slots)
        for row, n, slot in rec.prefills:
            y[row : row + n] = self._prefill(xbc[row : row + n], dt[row : row + n], A, state, slot)
        gated = self._gated_norm(y.view(-1, self.I), z).to(u.dtype)
        return adapt("mamba.out_proj", gated, self.out_proj(gated))

    # ---- the convolution ------------------------------------------------------------------------
    def _conv(self, xbc: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """xbc [B, n, conv_dim] after `prev` [B, conv_dim, d_conv - 1] (the inputs before) -> silu(conv) [B, n, conv_dim]."""
        seq = torch.cat([prev, xbc.transpose(1, 2)], dim=-1)
        bias = None if self.conv_bias is None else self.conv_bias.float()
        return F.silu(F.conv1d(seq, self.conv_weight.float(), bias, groups=self.conv_dim)).transpose(1, 2)

    def _split(self, xbc: torch.Tensor):
        x, B, C = xbc.split([self.I, self.G * self.N, self.G * self.N], dim=-1)
        rep = self.H // self.G  # heads per group
        B = B.unflatten(-1, (self.G, self.N)).repeat_interleave(rep, dim=-2)  # [..., H, N]
        C = C.unflatten(-1, (self.G, self.N)).repeat_interleave(rep, dim=-2)
        return x.unflatten(-1, (self.H, self.P)), B, C

    # ---- one token per sequence -----------------------------------------------------------------
    def _decode(self, xbc, dt, A, state: RecurrentState, slots: torch.Tensor) -> torch.Tensor:
        prev = state.conv.index_select(0, slots)
        k = self.d_conv - 1
        state.conv.index_copy_(0, slots, torch.cat([prev, xbc[:, :, None]], dim=-1)[..., -k:])
        x, B, C = self._split(self._conv(xbc[:, None], prev)[:, 0])  # x [b, H, P], B/C [b, H, N]
        h = state.ssm.index_select(0, slots)
        h = h * torch.exp(dt * A)[..., None, None] + (dt[..., None] * x)[..., None] * B[:, :, None, :]
        state.ssm.index_copy_(0, slots, h)
        return (h @ C[..., None]).squeeze(-1) + self.D.float()[None, :, None] * x

    # ---- a prefill chunk of one sequence --------------------------------------------------------
    def _prefill(self, xbc, dt, A, state: RecurrentState, slot: int) -> torch.Tensor:
        prev = state.conv[slot : slot + 1]
        k = self.d_conv - 1
        conv = self._conv(xbc[None], prev)[0]
        state.conv[slot] = torch.cat([prev[0], xbc.t()], dim=-1)[:, -k:]
        x, B, C = self._split(conv)  # [n, H, P], [n, H, N]
        h = state.ssm[slot]  # [H, P, N]
        out = []
        for a in range(0, xbc.shape[0], SUB_CHUNK):
            b = min(a + SUB_CHUNK, xbc.shape[0])
            y, h = self._ssd(x[a:b], B[a:b], C[a:b], dt[a:b], A, h)
            out.append(y)
        state.ssm[slot] = h
        return torch.cat(out) + self.D.float()[None, :, None] * x

    @staticmethod
    def _ssd(x, B, C, dt, A, h0):
        """The recurrence over n tokens in closed form: outputs [n, H, P] (without D x) and the final state."""
        L = torch.cumsum(dt * A, dim=0)  # [n, H]
        diff = L[:, None, :] - L[None, :, :]  # [t, s, H]: log decay from s to t
        causal = torch.ones(diff.shape[:2], dtype=torch.bool, device=x.device).tril()
        decay = torch.exp(diff.masked_fill(~causal[..., None], float("-inf")))
        weights = torch.einsum("thn,shn->tsh", C, B) * decay * dt[None]  # [t, s, H]
        y = torch.einsum("tsh,shp->thp", weights, x) + torch.einsum("thn,hpn->thp", C, h0) * torch.exp(L)[..., None]
        to_end = torch.exp(L[-1][None] - L) * dt  # [s, H]
        h = torch.exp(L[-1])[:, None, None] * h0 + torch.einsum("sh,shp,shn->hpn", to_end, x, B)
        return y, h

    def _gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """rmsnorm(y * silu(z)) over groups of I / n_groups channels, times the weight (float32)."""
        g = (y * F.silu(z)).unflatten(-1, (self.G, -1))
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.norm_weight.float() * g.flatten(-2)

    def load_weight(self, parts: list[str], tensor: torch.Tensor) -> None:
        """parts: a checkpoint name after `mamba.` ('in_proj.weight', 'conv1d.weight', 'A_log', ...)."""
        name = ".".join(parts)
        if parts[0] in ("in_proj", "out_proj") and len(parts) == 2:
            getattr(self, parts[0]).load(parts[1], tensor)
            return
        target = {"conv1d.weight": self.conv_weight, "conv1d.bias": self.conv_bias, "dt_bias": self.dt_bias,
                  "A_log": self.A_log, "D": self.D, "norm.weight": self.norm_weight}.get(name)
        if target is None or target.shape != tensor.shape:
            raise ValueError(f"checkpoint tensor mamba.{name} {tuple(tensor.shape)} has no place in a Mamba-2 mixer")
        target.data.copy_(tensor)
