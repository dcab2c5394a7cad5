"""The roofline arithmetic behind `sieve plan`: what bounds a decode step, and how many users fit.

A decode step at batch b reads the weights once and each sequence's KV at its context, and does
2 FLOPs per active weight per token plus attention. Its time floor is the larger of bytes / bandwidth
and FLOPs / compute. A batch is admissible when its step time meets the TPOT target and its
sequences' KV fits in the memory the weights leave.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from sieve.plan.devices import Device
from sieve.plan.shape import ModelShape

MEMORY_UTILIZATION = 0.9  # share of device memory the engine may use (vLLM's default)


@dataclass(frozen=True)
class Workload:
    weights: str = "bf16"
    kv: str = "bf16"
    context: int = 4096  # prompt tokens
    output_tokens: int = 512
    slo_tpot_ms: float = 50.0
    slo_ttft_ms: float = 2000.0
    spec_tokens: int = 0  # speculative tokens per step (0: off)
    acceptance: float = 0.7  # per-token acceptance rate of the speculation
    shared_prefix_tokens: int = 0  # leading prompt tokens every sequence shares (prefix caching keeps them once)
    tensor_parallel: int = 1  # devices the model is split over (Megatron-style, one all-reduce per attention and MLP block)


@dataclass
class Point:
    batch: int
    step_ms: float  # decode step floor
    bytes_per_step: float
    flops_per_step: float
    bound: str  # "bandwidth" | "compute"
    tokens_per_s_per_user: float
    tokens_per_s_total: float
    comm_ms: float = 0.0  # tensor parallelism: the step's all-reduces and logits gather, not overlapped with compute


def compute_dtype(device: Device, weights: str) -> str:
    """FP8 weights use FP8 tensor cores where the device has them, W8A8 its int8 ones; everything else computes in
    16-bit (a device without the faster path falls back to its 16-bit rate: `Device.flops`)."""
    if weights == "fp8" and device.has("fp8"):
        return "fp8"
    return "int8" if weights == "w8a8" else "bf16"


def decode_point(m: ModelShape, dev: Device, w: Workload, batch: int) -> Point:
    """One decode step at `batch`. With tensor parallelism over N devices each reads 1/N of the weights and KV and does
    1/N of the FLOPs, then the step waits for its collectives (`comm_seconds`). Bytes and FLOPs are the whole group's."""
    ctx = w.context  # KV read per sequence: the given context
    tokens = 1 + w.spec_tokens  # tokens each sequence verifies per step
    n = w.tensor_parallel
    bytes_ = m.step_weight_bytes(w.weights, batch) + batch * m.kv_bytes(ctx, w.kv)
    flops = batch * tokens * m.flops_per_token(ctx)
    t_mem = bytes_ / n / (dev.bandwidth_gbps * 1e9)
    t_cmp = flops / n / dev.flops(compute_dtype(dev, w.weights))
    t_comm = comm_seconds(m, dev, n, batch * tokens)
    step = max(t_mem, t_cmp) + t_comm
    per_step = expected_tokens_per_step(w)
    bound = "bandwidth" if t_mem >= t_cmp else "compute"
    if t_comm > max(t_mem, t_cmp):
        bound = "interconnect"
    return Point(batch, step * 1e3, bytes_, flops, bound, per_step / step, batch * per_step / step, t_comm * 1e3)


def comm_seconds(m: ModelShape, dev: Device, n: int, rows: int) -> float:
    """Collectives of one tensor-parallel step over `rows` token rows: two ring all-reduces of [rows, hidden] 16-bit per
    layer (after attention, after the MLP), each 2 (n - 1) / n of its bytes over the link plus a fixed latency, and one
    all-gather of the float32 logits."""
    if n <= 1:
        return 0.0
    if dev.link_gbps <= 0:
        raise ValueError(f"{dev.name} has no device-to-device link in the table: tensor parallelism cannot be planned on it")
    link, lat = dev.link_gbps * 1e9, dev.link_latency_us * 1e-6
    all_reduce = 2 * (n - 1) / n * rows * m.hidden * 2 / link + lat
    gather = (n - 1) / n * rows * m.vocab * 4 / link + lat
    return 2 * m.num_layers * all_reduce + gather


def expected_tokens_per_step(w: Workload) -> float:
    """Tokens a sequence gains per verification step with k speculative tokens at acceptance a:
    (1 - a^(k+1)) / (1 - a) (the accepted run plus the corrected or bonus token)."""
    k, a = w.spec_tokens, w.acceptance
    if k == 0:
        return 1.0
    return (k + 1) if a >= 1 else (1 - a ** (k + 1)) / (1 - a)


def kv_memory_bytes(m: ModelShape, dev: Device, w: Workload) -> float:
    """KV memory of the whole group (tensor parallelism: N devices hold one copy of the weights between them)."""
    return MEMORY_UTILIZATION * dev.memory_gb * 1e9 * w.tensor_parallel - m.weight_bytes(w.weights)


def sequences_that_fit(m: ModelShape, dev: Device, w: Workload) -> int:
    """Sequences whose KV fits beside the weights; a shared prefix is held once (prefix caching)."""
    shared = m.kv_bytes(min(w.shared_prefix_tokens, w.context), w.kv) if w.shared_prefix_tokens else 0.0
    per_seq = m.kv_bytes(w.context + w.output_tokens, w.kv) - shared
    return max(0, int((kv_memory_bytes(m, dev, w) - shared) // per_seq))


def prefill_ms(m: ModelShape, dev: Device, w: Workload) -> float:
    """Time to first token floor for one prompt of `context` tokens (compute or bandwidth bound)."""
    n = w.tensor_parallel
    flops = sum(m.flops_per_token(i) for i in (0, w.context // 2, w.context)) / 3 * w.context
    t_cmp = flops / n / dev.flops(compute_dtype(dev, w.weights))
    t_mem = (m.step_weight_bytes(w.weights, w.context) + m.kv_bytes(w.context, w.kv)) / n / (dev.bandwidth_gbps * 1e9)
    return (max(t_cmp, t_mem) + comm_seconds(m, dev, n, w.context)) * 1e3


@dataclass
class Disaggregation:
    """Prefill/decode disaggregation for one prompt of `context` tokens: the KV a prefill device sends a decode device,
    the time it takes over the link, and the prefill time a colocated device would spend instead of decoding (every
    running user's next token waits that long, in total, for each such prompt)."""

    link_gbps: float
    kv_bytes: float
    transfer_ms: float  # added to that request's TTFT (unless the transfer overlaps the prefill, layer by layer)
    prefill_ms: float  # the stall P/D removes from the decode device
    transfer_per_prefill: float  # transfer_ms / prefill_ms: well below 1 where P/D pays; near or above 1 it costs TTFT


def disaggregation(m: ModelShape, dev: Device, w: Workload, link_gbps: float) -> Disaggregation:
    kv = m.kv_bytes(w.context, w.kv)
    transfer = kv / (link_gbps * 1e9) * 1e3
    prefill = prefill_ms(m, dev, w)
    return Disaggregation(link_gbps, kv, transfer, prefill, transfer / prefill)


def tpot_ms(p: Point, w: Workload) -> float:
    return p.step_ms / expected_tokens_per_step(w)


def max_batch_within_slo(m: ModelShape, dev: Device, w: Workload) -> tuple[int, str]:
    """Largest batch whose TPOT meets the SLO and whose KV fits; and what stopped it growing."""
    fit = sequences_that_fit(m, dev, w)
    if fit < 1:
        return 0, "memory capacity"
    if tpot_ms(decode_point(m, dev, w, 1), w) > w.slo_tpot_ms:
        return 0, decode_point(m, dev, w, 1).bound
    lo, hi = 1, fit
    if tpot_ms(decode_point(m, dev, w, hi), w) <= w.slo_tpot_ms:
        return fit, "memory capacity"
    while lo < hi - 1:  # step time grows with batch: bisect for the last batch within the SLO
        mid = (lo + hi) // 2
        if tpot_ms(decode_point(m, dev, w, mid), w) <= w.slo_tpot_ms:
            lo = mid
        else:
            hi = mid
    return lo, decode_point(m, dev, w, hi).bound


@dataclass
class Plan:
    model: str
    device: str
    workload: dict
    total_params: float
    active_params: float
    weight_bytes: float
    kv_bytes_per_token: float  # past the window, where layers slide
    kv_bytes_per_sequence: float  # at context + output tokens
    ridge_flop_per_byte: float
    decode_intensity_b1: float
    decode_intensity_at_users: float
    prefill_intensity: float
    decode_step_ms: float  # batch 1, at the given context
    decode_bound_b1: str
    tokens_per_s_b1: float
    prefill_ms: float
    sequences_that_fit: int
    max_batch_within_slo: int
    users_per_device: int
    binding: str
    tokens_per_s_total_at_users: float
    meets_ttft_slo: bool


def plan(m: ModelShape, dev: Device, w: Workload) -> Plan:
    b1 = decode_point(m, dev, w, 1)
    users, binding = max_batch_within_slo(m, dev, w)
    at_users = decode_point(m, dev, w, max(users, 1))
    ttft = prefill_ms(m, dev, w)
    prefill_flops = m.flops_per_token(w.context // 2) * w.context
    prefill_bytes = m.step_weight_bytes(w.weights, w.context) + m.kv_bytes(w.context, w.kv)
    return Plan(
        model=m.name, device=dev.name, workload=asdict(w),
        total_params=m.total_params, active_params=m.active_params,
        weight_bytes=m.weight_bytes(w.weights), kv_bytes_per_token=m.kv_bytes_per_token(w.kv),
        kv_bytes_per_sequence=m.kv_bytes(w.context + w.output_tokens, w.kv),
        ridge_flop_per_byte=dev.flops(compute_dtype(dev, w.weights)) / (dev.bandwidth_gbps * 1e9),
        decode_intensity_b1=b1.flops_per_step / b1.bytes_per_step,
        decode_intensity_at_users=at_users.flops_per_step / at_users.bytes_per_step,
        prefill_intensity=prefill_flops / prefill_bytes,
        decode_step_ms=b1.step_ms, decode_bound_b1=b1.bound, tokens_per_s_b1=b1.tokens_per_s_per_user,
        prefill_ms=ttft, sequences_that_fit=sequences_that_fit(m, dev, w), max_batch_within_slo=users,
        users_per_device=users if ttft <= w.slo_ttft_ms else 0, binding=binding if ttft <= w.slo_ttft_ms else "compute (TTFT)",
        tokens_per_s_total_at_users=at_users.tokens_per_s_total if users else 0.0, meets_ttft_slo=ttft <= w.slo_ttft_ms,
    )


@dataclass
class Rung:
    name: str
    users: int
    factor: float  # over naive
    binding: str
    tpot_ms: float


def ladder(m: ModelShape, dev: Device, w: Workload, spec_tokens: int, acceptance: float) -> list[Rung]:
    """Users per device at the SLO, one change at a time on top of the previous rung."""
    low_weights = "fp8" if dev.has("fp8") else "int8"
    steps = [
        ("naive: one request at a time", dict(weights="bf16", kv="bf16", spec_tokens=0), True),
        ("continuous batching", dict(weights="bf16", kv="bf16", spec_tokens=0), False),
        (f"{low_weights.upper()} weights", dict(weights=low_weights, kv="bf16", spec_tokens=0), False),
        (f"speculative decoding (k={spec_tokens}, acceptance {acceptance:g})",
         dict(weights=low_weights, kv="bf16", spec_tokens=spec_tokens, acceptance=acceptance), False),
        ("FP8 KV cache", dict(weights=low_weights, kv="fp8", spec_tokens=spec_tokens, acceptance=acceptance), False),
        ("INT4 weights", dict(weights="int4", kv="fp8", spec_tokens=spec_tokens, acceptance=acceptance), False),
    ]
    rungs: list[Rung] = []
    base = None
    for name, change, naive in steps:
        wl = Workload(**{**asdict(w), **change})
        if naive:
            p = decode_point(m, dev, wl, 1)
            ok = tpot_ms(p, wl) <= wl.slo_tpot_ms and sequences_that_fit(m, dev, wl) >= 1
            users, binding, t = int(ok), "one request at a time", tpot_ms(p, wl)
        else:
            users, binding = max_batch_within_slo(m, dev, wl)
            t = tpot_ms(decode_point(m, dev, wl, max(users, 1)), wl)
        base = base if base is not None else max(users, 1)
        rungs.append(Rung(name, users, users / base, binding, t))
    return rungs


# ------------------------------------------------------------------------------------ a closed loop, calibrated
@dataclass(frozen=True)
class Calibration:
    """The terms the roofline leaves out, each measured on the run it explains (`sieve bench ladder`)."""

    fixed_ms: float = 0.0  # a step's cost no byte or FLOP accounts for (scheduling, sampling, Python, launches)
    compute_scale: float = 1.0  # measured seconds per second of the step's FLOPs at the device's peak rate
    p99_over_mean: float = 1.0  # a user's TPOT p99 over the TPOT of the mean step at the same load
    prefill_tokens_per_turn: float = 0.0  # new prompt tokens each turn of a closed loop brings (the rest is cached)
    step_share: float = 1.0  # the share of the TPOT objective the mean step reaches when a paced server holds newcomers
    queue_p99_over_mean: float = 0.0  # a queued turn's TTFT p99 over the FIFO queue's mean wait (0: no queue counted)


def steady_prefill_rows(w: Workload, cal: Calibration, batch: int) -> float:
    """A closed loop's steady prefill load: each of `batch` users brings `prefill_tokens_per_turn` new prompt tokens
    every turn, and a turn decodes for output_tokens / expected-tokens-per-step steps, so each step carries on
    average batch x tokens / steps-per-turn prompt rows beside the decodes (stall-free chunks)."""
    steps_per_turn = max(w.output_tokens / expected_tokens_per_step(w), 1.0)
    return batch * cal.prefill_tokens_per_turn / steps_per_turn


def step_terms(m: ModelShape, dev: Device, w: Workload, batch: int, cal: Calibration) -> tuple[float, float]:
    """The two parts of a closed loop's mean step, in ms: its bytes (weights, every sequence's KV) at the device's
    bandwidth, and its FLOPs at the device's peak rate: the decode rows' (attention over their context included) and
    the steady prefill rows' (a prompt row attends to half the context on average; the weights are read once for
    all rows). Tensor parallelism divides both."""
    p = decode_point(m, dev, w, batch)
    n = w.tensor_parallel
    return (1e3 * p.bytes_per_step / n / (dev.bandwidth_gbps * 1e9),
            1e3 * closed_loop_flops(m, w, cal, batch) / n / dev.flops(compute_dtype(dev, w.weights)))


def closed_loop_flops(m: ModelShape, w: Workload, cal: Calibration, batch: int) -> float:
    """A closed loop's mean step's FLOPs: the decode step's plus the steady prefill rows'."""
    tokens = 1 + w.spec_tokens
    return (batch * tokens * m.flops_per_token(w.context)
            + steady_prefill_rows(w, cal, batch) * m.flops_per_token(w.context // 2))


def closed_loop_point(m: ModelShape, dev: Device, w: Workload, batch: int, cal: Calibration) -> Point:
    """The mean step of a closed loop of `batch` users: its bytes' time at the measured bandwidth plus its FLOPs' time
    at the rate a step attains (`compute_scale` x the peak's: `step_terms`), plus the collectives and the step's
    fixed cost. The two add where the roofline takes the larger: the steps measured on a CPU overlap little of one
    with the other, and attain a fraction of the peak FLOP/s a large GEMM reaches, so that the roofline called
    bandwidth-bound the steps in which every row cost arithmetic."""
    p = decode_point(m, dev, w, batch)
    t_mem, t_cmp = step_terms(m, dev, w, batch, cal)
    t_cmp *= cal.compute_scale
    step = t_mem + t_cmp + p.comm_ms + cal.fixed_ms
    flops = closed_loop_flops(m, w, cal, batch)
    per_step = expected_tokens_per_step(w)
    return Point(batch, step, p.bytes_per_step, flops, "bandwidth" if t_mem >= t_cmp else "compute",
                 per_step / step * 1e3, batch * per_step / step * 1e3, p.comm_ms)


def tpot_p99_ms(m: ModelShape, dev: Device, w: Workload, batch: int, cal: Calibration) -> float:
    return tpot_ms(closed_loop_point(m, dev, w, batch, cal), w) * cal.p99_over_mean


def running_capacity(m: ModelShape, dev: Device, w: Workload, cal: Calibration) -> tuple[int, str]:
    """The running batch a closed loop holds within the TPOT objective: the largest whose KV fits, whose mean TPOT
    stays within `step_share` of the objective (a paced server admits no more) and whose p99 TPOT (`tpot_p99_ms`)
    within it; and what binds."""
    fit = sequences_that_fit(m, dev, w)
    if fit < 1:
        return 0, "memory capacity"

    def within(b: int) -> bool:
        p = closed_loop_point(m, dev, w, b, cal)
        return tpot_ms(p, w) <= cal.step_share * w.slo_tpot_ms and tpot_ms(p, w) * cal.p99_over_mean <= w.slo_tpot_ms

    if not within(1):
        return 0, closed_loop_point(m, dev, w, 1, cal).bound
    if within(fit):
        return fit, "memory capacity"
    lo, hi = 1, fit
    while lo < hi - 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if within(mid) else (lo, mid)
    return lo, closed_loop_point(m, dev, w, hi, cal).bound


def turn_ms(m: ModelShape, dev: Device, w: Workload, batch: int, cal: Calibration) -> float:
    """How long one turn decodes in a running batch of `batch`: its output tokens at the batch's mean TPOT."""
    return w.output_tokens * tpot_ms(closed_loop_point(m, dev, w, batch, cal), w)


def queued_users(m: ModelShape, dev: Device, w: Workload, batch: int, cal: Calibration) -> int:
    """Turns that can wait behind a full running batch of `batch` with TTFT p99 within its objective. A FIFO queue
    moves up one place each time a running turn ends, every turn_ms / batch on average, so the last of q queued
    turns waits q x turn_ms / batch on average; its p99 is `queue_p99_over_mean` times that, and its prompt then
    takes a step."""
    if batch < 1 or cal.queue_p99_over_mean <= 0:
        return 0
    room = w.slo_ttft_ms - closed_loop_point(m, dev, w, batch, cal).step_ms
    per_turn = cal.queue_p99_over_mean * turn_ms(m, dev, w, batch, cal) / batch
    return max(0, int(room // per_turn))


def closed_loop_users(m: ModelShape, dev: Device, w: Workload, cal: Calibration) -> tuple[int, str]:
    """Users a closed loop keeps within the SLO: the running batch (`running_capacity`) plus the turns that wait in
    the queue within the TTFT objective (`queued_users`); and what binds the running batch."""
    batch, binding = running_capacity(m, dev, w, cal)
    queued = queued_users(m, dev, w, batch, cal)
    return batch + queued, binding + (f", {queued} more waiting within TTFT" if queued else "")
