"""Greedy rows' next tokens from a bf16 LM head at about half its bytes, exactly the plain path's.

A greedy row needs its logits' argmax, not its logits. The head's int8 sketch (per-row scale s_n, codes q_n: 7 bits
where the kernel multiplies them in bf16 dot products, 8 on AVX2) bounds every logit for any hidden state x:
|x . w_n - s_n x . q_n| <= |x| |w_n - s_n q_n|, plus slack for float32 summation (one radius per row, precomputed
here). The native kernel (sieve/kernels/greedy_head.cpp) reads the sketch, keeps the rows whose interval reaches the
best lower bound (on SmolLM2-135M's chat answers a median of 13 of 49,152, at most ~1,000), and multiplies those rows by the same GEMV as
the plain path, so the token is the plain path's, bit for bit, ties included (the first index of the max). A bf16
head's decode step then reads 1 byte a weight of it instead of 2: SmolLM2-135M's tied 49,152 x 576 head is 28 MB of
a bf16 step's 241 MB instead of 57 of 269.

A GGUF Q8_0 head (int8 already) gets the same exactness another way (`GreedyHeadQ8`, below): its own codes against the
hidden state quantized to int8, bounded by each row's norm, with AVX512-VNNI's 4-product dot instruction.

It applies to rows that take the raw argmax (greedy, no penalty, bias, ban, grammar or logprobs: the runner's
`plain_greedy`), up to the GEMV's rows (the plain path's logits above them come from another kernel), on a bf16 head
with no bias, and no final logit soft-capping. `--no-greedy-head-sketch` turns it off.
"""

from __future__ import annotations

import torch

from sieve.kernels import cpu_ops

_PAD = 32  # codes are zero padded to a multiple of 32 inputs (the AVX512-BF16 kernel's dot product; AVX2 reads 8)
_CHUNK = 4096  # rows per pass when building the sketch (float64 temporaries of [_CHUNK, K])


class GreedyHead:
    """The int8 sketch of one bf16 head weight [N, K], and `__call__(hidden) -> token ids or None`."""

    def __init__(self, weight: torch.Tensor):
        self.ops = cpu_ops()
        self.weight = weight.detach()
        N, K = self.weight.shape
        Kp = -(-K // _PAD) * _PAD
        top = self.ops.greedy_head_code_max  # 63 where the kernel multiplies 192 + q in bf16, else 127
        self.codes = torch.zeros(N, Kp, dtype=torch.int8)
        self.scale = torch.empty(N, dtype=torch.float32)
        self.radius = torch.empty(N, dtype=torch.float32)
        for lo in range(0, N, _CHUNK):
            w = self.weight[lo: lo + _CHUNK].double()
            s = (w.abs().amax(dim=1) / top).clamp_min(1e-30)
            q = torch.round(w / s[:, None]).clamp_(-top, top)
            residual = (w - q * s[:, None]).norm(dim=1)
            # slack for the float32 sums of both the sketch's and the GEMV's dot products (n u |x| |terms|, n <= 2^12)
            slack = (w.norm(dim=1) + s * q.norm(dim=1)) * 2.0**-10
            self.codes[lo: lo + _CHUNK, :K] = q.to(torch.int8)
            self.scale[lo: lo + _CHUNK] = s.float()
            self.radius[lo: lo + _CHUNK] = ((residual + slack) * (1 + 2.0**-16)).float()
        self.max_rows = self.ops.gemv_max_rows
        self.last_candidates: torch.Tensor | None = None  # per row of the last call: rows multiplied exactly

    @staticmethod
    def supported(head, softcapping: float | None) -> bool:
        """A plain bf16 native linear on CPU (the GEMV the plain path runs), no bias, no logit soft-capping."""
        if head.weight is None or head.weight.device.type != "cpu":  # before cpu_ops(): a GPU head builds no CPU kernels
            return False
        ops = cpu_ops()
        return (ops is not None and hasattr(ops, "greedy_head") and softcapping is None and head.native is not None
                and head.qkernel is None and head.weight.dtype == torch.bfloat16
                and head.bias is None and head.weight.shape[1] <= 4096)

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + 8 * self.scale.numel()

    @property
    def step_bytes_change(self) -> int:
        """Bytes a greedy step reads, less what the plain head reads: the sketch instead of the bf16 head."""
        return self.nbytes - self.weight.numel() * self.weight.element_size()

    def describe(self) -> str:
        return f"the LM head's int8 sketch ({self.nbytes / 1e6:.1f} MB, exact)"

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [M, K] bf16 -> the argmax of each row's logits, or None where the sketch cannot answer (more rows
        than the GEMV takes, or a row that is not finite): the caller computes the logits."""
        if not 1 <= hidden.shape[0] <= self.max_rows or hidden.dtype != torch.bfloat16:
            return None
        ids, self.last_candidates = self.ops.greedy_head(hidden, self.weight, self.codes, self.scale, self.radius)
        return None if bool((ids < 0).any()) else ids


class GreedyHeadQ8:
    """A GGUF Q8_0 head (int8 codes, a float16 scale per 32 inputs) for float32 hidden states: greedy rows' tokens
    from the file's own codes against int8-quantized activations (AVX512-VNNI, sieve/kernels/greedy_head.cpp), exactly
    the plain path's. The sketch is the weight itself; what it adds is each row's norm |W_n| (4 bytes a row), which
    bounds every logit's distance from the sketch: |W_n| (|r| + slack), r the activations' rounding residual. At 1
    row it reads the bytes the plain kernel reads; at 2 to 8 rows (a step verifying drafted tokens) it multiplies
    4 products per instruction where the plain kernel's bf16 dot products take 2, after widening every code. Where the
    CPU has AMX-INT8 tiles, the sketch of 9 rows or more is one tile product per 16 rows and 32 inputs (the same
    integer sums, so the same answers). It answers steps of any size, 64 rows a call (users verifying drafts), where the
    plain path would compute every logit."""

    def __init__(self, native):
        self.ops = cpu_ops()
        self.max_rows = self.ops.greedy_head_q8_max_rows()
        self.native = native
        w, s = native.weight, native.scale  # [N/16, K2/2, 16, 2] bytes, [N/16, G, 16] float16
        blocks, half = w.shape[0], w.shape[1]
        G = s.shape[1]
        codes = w.view(torch.int8).view(blocks, half, 16, 2).permute(0, 2, 1, 3).reshape(blocks * 16, 2 * half)
        scales = s.permute(0, 2, 1).reshape(blocks * 16, G)
        self.wnorm = torch.empty(native.n, dtype=torch.float32)
        for lo in range(0, native.n, _CHUNK):
            hi = min(native.n, lo + _CHUNK)
            sq = codes[lo:hi].double().square().view(hi - lo, G, -1).sum(-1)  # per group: sum of q^2
            norm = (sq * scales[lo:hi].double().square()).sum(-1).sqrt()
            self.wnorm[lo:hi] = (norm * (1 + 2.0**-20)).float()  # rounded up
        self.last_candidates: torch.Tensor | None = None

    @staticmethod
    def supported(head, softcapping: float | None) -> bool:
        """A Q8_0 native head (groups of 32, no bias) under float32 activations, on a CPU build with AVX512-VNNI, no
        logit soft-capping. (Under bf16 activations the plain logits are rounded to bf16: this bound does not cover it.)"""
        native = getattr(head, "native", None)
        if native is None:  # only a CPU linear has a native kernel (and a GPU head builds no CPU kernels)
            return False
        ops = cpu_ops()
        return (ops is not None and hasattr(ops, "greedy_head_q8") and softcapping is None
                and head.dtype == torch.float32
                and head.qkernel is not None and getattr(native, "kind", None) == ops.LINEAR_Q8 and not native.fp8
                and native.group == 32 and head.bias is None and native.weight.shape[1] * 2 <= 4096)

    @property
    def nbytes(self) -> int:
        return 4 * self.wnorm.numel()

    @property
    def step_bytes_change(self) -> int:
        """Bytes a greedy step reads, less what the plain head reads: the same codes and scales, plus the norms."""
        return self.nbytes

    def describe(self) -> str:
        return f"the Q8_0 head's codes against int8 activations (+{self.nbytes / 1e6:.1f} MB of row norms, exact)"

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [M, K] float32 -> each row's argmax, max_rows rows a call (a row's answer does not depend on the rows
        beside it), or None where it does not apply (bf16 rows, whose plain logits are rounded to bf16; a row that is not
        finite): the caller computes the logits."""
        if hidden.shape[0] < 1 or hidden.dtype != torch.float32:
            return None
        n = self.native
        parts = [self.ops.greedy_head_q8(h, n.weight, n.scale, n.group, n.n, self.wnorm) for h in hidden.split(self.max_rows)]
        ids, self.last_candidates = parts[0] if len(parts) == 1 else (torch.cat(p) for p in zip(*parts))
        return None if bool((ids < 0).any()) else ids
