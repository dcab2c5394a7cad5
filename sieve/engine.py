"""The engine: request -> scheduler -> model runner -> sampler -> output processor.

The interface the offline API and the server drive:
    add_request(request_id, prompt, params, priority=0)
    step() -> list[RequestOutput]   (every request that made progress; `.finished` on the last)
    abort(request_id)
    has_unfinished()
"""

from __future__ import annotations

import contextlib
import copy
import gc
import importlib.util
import itertools
import logging
import os
import time
from types import SimpleNamespace

import torch

import sieve.model_runner as model_runner
from sieve.block_manager import build_block_manager
from sieve.config import ConfigError, EngineConfig
from sieve.detokenizer import init_offsets
from sieve.device import pick_device
from sieve.kv_compression.compact import KVCompressor
from sieve.queue_eta import QueueETA, QueueEstimate
from sieve.tenancy import TierPolicy
from sieve.kv_fingerprint import kv_layout, kv_scales_digest
from sieve.kv_premise import KVPremise
from sieve.model_runner import ModelRunner
from sieve.models.arch import ModelArch
from sieve.models.default import resolve_default
from sieve.models.loader import default_num_threads, load_model, open_checkpoint, resolve_dtype
from sieve.output_processor import OutputProcessor
from sieve.outputs import RequestMetrics, RequestOutput
from sieve.pacing import SloPacer
from sieve.lora import LoRAError, LoRAManager
from sieve.pooling import Pooler
from sieve.sampling_params import SamplingParams
from sieve.scheduler import Scheduler
from sieve.sequence import Request, Sequence, WindowState
from sieve.spec_decode.build import build_speculator
from sieve.stats import EngineStats, KVTransferStats, LoRAStats, SpecDecodeStats, StructuredStats
from sieve.step_cost import StepCostModel, calibrate_step_cost, decode_keys
from sieve.structured import GrammarCompiler, GrammarError

log = logging.getLogger("sieve")

Prompt = str | dict | list[int]


# Calibration text for FP8 KV scales: prose, dialogue, code and numbers, so activations of several kinds are seen.
KV_CALIBRATION_TEXT = (
    "The committee met on Tuesday to review the budget. After a long discussion, they agreed to fund the new library, "
    "repair the bridge over the river, and hire three teachers for the school in the north of the town.\n"
    "\"Where are you going?\" asked Maria. \"To the market,\" said Tom, \"we need bread, eggs and 2 kg of apples.\"\n"
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "print([fibonacci(i) for i in range(10)])  # [0, 1, 1, 2, 3, 5, 8, 13, 21, 34]\n"
    "Photosynthesis converts light energy into chemical energy: 6 CO2 + 6 H2O -> C6H12O6 + 6 O2. "
    "In 1969, Apollo 11 landed on the Moon; the mission lasted 8 days, 3 hours and 18 minutes.\n"
    "User: Can you summarise the main causes of the French Revolution?\nAssistant: Its main causes were a fiscal crisis, "
    "food shortages, resentment of the privileges of the nobility and clergy, and Enlightenment ideas about rights."
)


class RequestError(ValueError):
    """A request the engine refuses (bad prompt, too long, cannot ever fit)."""


class ServerBusy(RequestError):
    """A request refused for now, not for what it asks (a prefill server's KV export store is full): retry later."""


class EngineDead(RuntimeError):
    """The engine cannot step again (a tensor-parallel rank is gone): every request fails and the server exits."""


class StepFailed(RuntimeError):
    """A step raised: the requests it held (`request_ids`) are aborted, every other request goes on."""

    def __init__(self, request_ids: list[str], cause: Exception):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.request_ids = request_ids


class StructuredCounters:
    """Structured-output counters (the server's /metrics reads them): token-mask time and rows, steps that masked."""

    def __init__(self) -> None:
        self.mask_seconds = 0.0
        self.num_masked_steps = 0
        self.num_masked_rows = 0


class LLMEngine:
    def __init__(self, config: EngineConfig):
        config.model, self.model_name = resolve_default(config.model)  # model_name: what the server calls it by default
        self.config = config
        self.device = pick_device(config.device)
        if self.device.type == "cpu":  # ranks of one host share its cores
            local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", config.tensor_parallel_size))
            torch.set_num_threads(config.num_threads or max(1, default_num_threads() // max(1, local_ranks)))
        torch.manual_seed(config.seed)
        ckpt = self._open(config)
        self._fit_config(config)
        self._load(ckpt, config)
        self._build_cache(ckpt, config)
        self.runner.prepare_static_decode(self._most_decode_rows(config))
        # What a step costs on this machine, where a run-time choice needs it: SLO pacing, speculation's "auto"
        spec_auto = config.speculative_config is not None and config.speculative_config.auto
        self.step_cost = StepCostModel() if spec_auto or config.slo_tpot_ms or config.slo_reject else None
        pacer = None
        if config.slo_tpot_ms:
            pacer = SloPacer(self.step_cost, config.slo_tpot_ms / 1e3, config.max_num_batched_tokens, config.block_size)
        # the expected wait of queued requests, from the steps' measured cost (the SLO's model where there is one)
        self.step_timer = self.step_cost if self.step_cost is not None else StepCostModel()
        self.queue_eta = QueueETA(self.step_timer, config.max_num_seqs, config.max_num_batched_tokens, config.block_size)
        self.queue_head_eta_s: float | None = None
        self.tier_head_eta_s: dict[str, float] = {}  # each tier's first waiting request's: a full tier's Retry-After
        self._tier_heads_at = float("-inf")
        self.track_queue_head = False  # keep them current each step (a server with --max-waiting, or a tier's, asks)
        tiers = TierPolicy(dict(config.tier_shares), config.max_num_seqs) if config.tier_shares is not None else None
        self.scheduler = Scheduler(config, self.block_manager, pacer, tiers)
        self.kv_compressor = KVCompressor(config.kv_compression, self.arch, self.runner, self.block_manager,
                                          config.tensor_parallel_size > 1, config.kv_budget_profile)
        self.kv_connector = None
        if config.kv_role is not None or config.kv_transfer_config is not None:
            from sieve.distributed.kv_transfer import build_kv_connector  # (the disaggregated roles' only)

            if self.tp_workers is not None:
                raise ConfigError("KV transfer is not built together with tensor parallelism yet")
            self.kv_connector = build_kv_connector(config, ckpt, self.arch, self.dtype, self.runner, self.block_manager)
        self.lora = self._build_lora(config)
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids, config.max_model_len)
        self.speculator = None
        if config.speculative_config is not None:
            self.speculator = build_speculator(config.speculative_config, self.arch, self.runner, self.device, self.dtype,
                                               config.max_model_len, config.max_num_batched_tokens, self._draft_engine,
                                               config.slo_tpot_ms, self.step_cost)
        # Drafting's choice, and the pacer's, need the cost of every small row count from the first step: a model
        # that learns it from the first requests alone takes their warm-up for the machine's speed (SmolLM2: two rows
        # at 40-86 ms, ten times their cost, under a burst), and a row count it then never admits is never measured again.
        if spec_auto or pacer is not None:
            calibrate_step_cost(self.step_cost, self._time_decode_rows, config, len(self.runner.layer_groups) > 1 or bool(self.arch.mamba_layers),
                                self.block_manager.num_free_blocks * config.block_size, self._borrowed_blocks)
        self.kv_tiers = self._build_tiers(config) if config.kv_tiers_on else None
        if self.kv_tiers is not None:
            self.scheduler.restore_kv = self._restore_from_tiers
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self.num_steps = 0
        # a quantized KV cache says in the log where memory does not bind (its premise)
        self.kv_premise = KVPremise(config.kv_cache_dtype) if config.kv_cache_dtype in ("fp8", "int8") else None
        # Everything loaded so far lives as long as the engine: keep it out of the cyclic collector's passes,
        # which otherwise walk the tokenizer's and the model's objects (~5% of a small model's decode step).
        gc.collect()
        gc.freeze()

    @staticmethod
    def _most_decode_rows(config: EngineConfig) -> int:
        """The decode rows a step may hold, capped at 512 (the largest CUDA graph captured by default): every running
        sequence with its most draft tokens, in every chain of its draft tree."""
        spec = config.speculative_config
        per_seq = spec.num_branches * (1 + spec.max_k) if spec is not None else 1
        return min(config.max_num_seqs * per_seq, 512)

    def _time_decode_rows(self, num_rows: int, tables, context: int = 0, logits: bool = True) -> float:
        if logits:
            return model_runner.time_decode_rows(self.runner, num_rows, tables, context)
        return model_runner.time_decode_rows(self.runner, num_rows, tables, context, logits=False)

    def _build_tiers(self, config: EngineConfig):
        """The KV tiers (sieve/kv_tiers), their cost model told what a prefill token costs here: decode rows at
        position 0 without their logits (a prompt's tokens without their attention, so recomputing looks, if anything,
        cheaper; with the logits, Gemma-3's 262k-word head tripled the price, and a tier slower than recomputing was
        taken)."""
        from sieve.kv_tiers import build_kv_tiers

        if self.tp_workers is not None:
            raise ConfigError("the KV tiers are not built together with tensor parallelism yet")
        rows = min(64, config.max_num_batched_tokens)
        with self._borrowed_blocks(1) as tables:
            self._time_decode_rows(rows, tables, logits=False)  # first calls allocate
            per_token = min(self._time_decode_rows(rows, tables, logits=False) for _ in range(3)) / rows
        return build_kv_tiers(config, self.kv_layout, kv_scales_digest(self.runner.caches), self.arch, self.runner,
                              self.block_manager, per_token)

    def _restore_from_tiers(self, seq) -> None:
        """A preempted sequence re-entering (the scheduler asks): the blocks of its tokens, prompt and generated, that
        the pool evicted while it waited, put back into the prefix cache from the nearest tier holding them, where the
        cost model says reading beats recomputing. They are the bytes its own steps wrote (every full block is written
        down as it enters the prefix cache), so it goes on as if never preempted. Read on this thread: the step waits
        for the read, which is cheaper than the prefill it replaces. A compressed sequence keeps no such blocks."""
        if seq.params.kv_compression is not None:
            return
        salt = seq.request.params.cache_salt
        self.kv_tiers.admit(seq.token_ids, self.kv_tiers.fetch(seq.token_ids, salt), salt, resumed=True)

    def _open(self, config: EngineConfig):
        """The checkpoint, and what its config says: the architecture, the dtype, the tokenizer, the EOS ids."""
        ckpt = open_checkpoint(config.model, config.revision, dequantize=config.dequantize)
        overrides = config.parsed_hf_overrides()
        if overrides:
            log.info("config fields overridden (hf_overrides): %s", overrides)
        self.arch = ModelArch.from_hf_config({**ckpt.config, **overrides})
        self.dtype = resolve_dtype(config.dtype, self.arch, self.device)
        if config.skip_tokenizer_init:
            self.tokenizer = None
        else:
            self.tokenizer = _load_tokenizer(config.tokenizer) if config.tokenizer else ckpt.tokenizer()
        eos = self.arch.eos_token_ids
        if not eos and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos = (self.tokenizer.eos_token_id,)
        self.eos_token_ids = tuple(eos)
        return ckpt

    def _fit_config(self, config: EngineConfig) -> None:
        """The context length, checked; what a model with recurrent layers cannot do, refused or turned off."""
        config.max_model_len = config.max_model_len or self.arch.max_position_embeddings
        config.validate()
        if self.arch.has_recurrent_state:
            if config.speculative_config is not None:
                raise ConfigError("speculative decoding is not built for models with recurrent (Mamba-2) layers: their state "
                                  "cannot be rolled back past rejected drafts")
            if config.enable_prefix_caching:
                log.info("prefix caching is off for this model: its Mamba-2 layers' state is not kept per block")
                config.enable_prefix_caching = False

    def _load(self, ckpt, config: EngineConfig) -> None:
        """The tensor-parallel ranks (this process is rank 0), the model (this rank's shard) and its runner."""
        self.tp_workers = None
        local_arch = self.arch
        if config.tensor_parallel_size > 1:
            from sieve.distributed import start_tensor_parallel

            self.tp_workers, local_arch = start_tensor_parallel(config, self.arch, self.device)
        try:
            model = load_model(ckpt, self.arch, self.dtype, self.device, max_positions=config.max_model_len,
                               quantization=config.quantization, group_size=config.quantization_group_size,
                               quantize_lm_head=config.quantize_lm_head, greedy_head=config.greedy_head_sketch,
                               tp=self.tp_workers.group if self.tp_workers else None)
            self.grammars = GrammarCompiler(self.tokenizer, self.arch.vocab_size, self.eos_token_ids)
            self.structured_stats = StructuredCounters()
            self.runner = ModelRunner(config, local_arch, model, self.dtype, self.device, self.eos_token_ids, self.grammars)
            if self.tp_workers is not None:
                self.tp_workers.ready((self.runner.num_blocks, self.runner.num_window_blocks))
        except BaseException:
            self.shutdown()
            raise

    def _build_cache(self, ckpt, config: EngineConfig) -> None:
        """The block manager over the runner's pool; the context length capped to what the pool holds for one
        sequence; FP8 KV scales calibrated where the checkpoint gives none."""
        # The namespace names what the blocks' contents depend on (sieve/kv_fingerprint.py), never the model's path,
        # so that a cache that outlives the pool (the KV tiers: a restart, another replica) can never mix models or
        # KV layouts, and finds its blocks again wherever the same model is served.
        namespace = self.kv_layout = kv_layout(ckpt.path, ckpt.config, self.dtype, self.runner.kv_dtype, self.runner.kv_pool.shape)
        self.block_manager = build_block_manager(self.arch, self.runner.num_blocks, self.runner.num_window_blocks, config.block_size,
                                                 config.max_num_seqs, config.enable_prefix_caching, namespace)
        capacity = self.runner.num_blocks * config.block_size
        if config.max_model_len > capacity:  # never advertise a context the KV pool cannot hold for even one sequence
            log.warning("max_model_len %d capped to %d: the KV cache holds %d blocks of %d tokens (give it more memory "
                        "with --kv-cache-memory-gb for longer contexts)",
                        config.max_model_len, capacity, self.runner.num_blocks, config.block_size)
            config.max_model_len = capacity
        if self.runner.kv_needs_calibration:
            self._calibrate_kv()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and the KV-transfer server, where there are any. The engine cannot step
        afterwards."""
        if getattr(self, "tp_workers", None) is not None:
            self.tp_workers.shutdown()
            self.tp_workers = None
        if getattr(self, "kv_connector", None) is not None:
            self.kv_connector.close()
            self.kv_connector = None
        if getattr(self, "kv_tiers", None) is not None:
            self.kv_tiers.close()
            self.kv_tiers = None

    def _calibrate_kv(self) -> None:
        """FP8 KV scales the checkpoint does not give are fixed here, once, from fixed text, so no request's
        output depends on which request happened to write the cache first."""
        ids = self.tokenizer.encode(KV_CALIBRATION_TEXT) if self.tokenizer is not None else []
        if len(ids) < 64:  # no tokenizer: a fixed spread of ids instead
            ids = [(7919 * i) % self.arch.vocab_size for i in range(256)]
        ids = ids[: max(1, min(len(ids), self.config.max_model_len, self.block_manager.num_blocks * self.config.block_size))]
        self.score(ids)
        log.info("FP8 KV scales calibrated at load on %d tokens of fixed text", len(ids))

    def _draft_engine(self, model: str, quantization: str | None = None) -> "LLMEngine":
        """The engine a draft model runs in: same device, dtype and context, its own KV pool and prefix cache (and
        its own weight format, where speculative_config.quantization names one)."""
        c = self.config
        draft = LLMEngine(EngineConfig(
            model=model, dtype=c.dtype, device=c.device, quantization=quantization, max_model_len=c.max_model_len, max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=c.max_num_batched_tokens, block_size=c.block_size, kv_cache_memory_gb=c.kv_cache_memory_gb,
            kv_cache_memory_fraction=c.kv_cache_memory_fraction / 2, num_gpu_blocks_override=c.num_gpu_blocks_override,
            num_threads=c.num_threads, seed=c.seed, skip_tokenizer_init=True))
        if draft.arch.vocab_size != self.arch.vocab_size:
            raise ConfigError(f"draft model {model!r} has a vocabulary of {draft.arch.vocab_size} tokens, the target "
                              f"{self.arch.vocab_size}: a draft model must share the target's tokenizer")
        return draft

    @contextlib.contextmanager
    def _borrowed_blocks(self, num_tokens: int):
        """Block tables (`block_table`, and `window.table` where the model has sliding layers) for `num_tokens`
        tokens, taken from the free pool between steps and given back after."""
        holder = SimpleNamespace(block_table=[], num_computed_tokens=0, num_registered_blocks=0, block_hashes=[],
                                 window=WindowState(), state_slot=-1, kv_dropped=0, kv_compressed=False)
        if not self.block_manager.allocate(holder, num_tokens):
            self.block_manager.free(holder)
            raise RequestError(f"{num_tokens} tokens do not fit in the free KV blocks")
        try:
            yield holder
        finally:
            self.block_manager.free(holder)

    # ---- requests --------------------------------------------------------------------------
    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise RequestError("a dict prompt must hold 'prompt_token_ids'")
            ids, text = list(prompt["prompt_token_ids"]), prompt.get("prompt")
        elif isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this engine has no tokenizer (skip_tokenizer_init): pass prompt_token_ids")
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            text, ids = None, list(prompt)
        else:
            raise RequestError(f"a prompt is a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")
        if not ids:
            raise RequestError("the prompt is empty")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise RequestError("prompt_token_ids must be a list of integer token ids")
        bad = [t for t in ids if not 0 <= t < self.arch.vocab_size]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is out of range for vocabulary size {self.arch.vocab_size}")
        return text, ids

    def _build_lora(self, config: EngineConfig) -> LoRAManager | None:
        """The adapters this engine serves (enable_lora), those of lora_modules registered now."""
        if not config.enable_lora:
            return None
        # float32 activations over quantized weights (the default CPU path) keep adapters in bf16: half the bytes a step
        # reads of them, against bases whose weights are 4 or 8 bits
        quantized = any(getattr(layer, "qkv_proj", None) is not None and layer.qkv_proj.qkernel is not None
                        for layer in self.runner.model.layers)
        weight_dtype = torch.bfloat16 if self.dtype == torch.float32 and quantized and self.device.type == "cpu" else self.dtype
        tp = self.runner.model.tp  # under tensor parallelism each rank keeps its shard of an adapter
        manager = LoRAManager(self.arch, weight_dtype, self.device, config.max_loras, config.max_lora_rank, config.max_cpu_loras, tp)
        if tp is not None:
            from sieve.distributed.lora_ranks import DriverAdapters

            tp.adapters = DriverAdapters(manager.max_cpu_loras, weight_dtype)
        if self.device.type == "cuda" and importlib.util.find_spec("triton") is not None:  # one launch for every adapter
            from sieve.lora.slots import LoRASlots

            self.runner.lora_slots = LoRASlots(self.runner.arch, config.max_loras, config.max_lora_rank, weight_dtype, self.device)
        for name, path in (config.lora_modules or {}).items():
            try:
                manager.load(name, path)
            except LoRAError as e:
                raise ConfigError(f"lora_modules {name}={path}: {e}") from None
        return manager

    def cache_salt(self, params: SamplingParams) -> str | None:
        """The namespace a request's blocks are hashed in: its cache_salt, and its adapter's fingerprint (the KV of one
        adapter is never another's, nor the base model's). A LoRAError if its adapter cannot be had."""
        if params.lora_request is None:
            return params.cache_salt
        if self.lora is None:
            raise LoRAError("this engine serves no LoRA adapters (start it with enable_lora / --enable-lora)")
        adapter = self.lora.resolve(params.lora_request)
        return f"lora:{adapter.fingerprint}" + (f"|{params.cache_salt}" if params.cache_salt else "")

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None, priority: int = 0,
                    kv_fetch=None, tenant: str | None = None, tier: str | None = None) -> None:
        """`kv_fetch`: the KV for this prompt fetched already off this thread: a decode server's blocks (`fetch_kv`) or
        the KV tiers' (`fetch_tiers`),
        as the server does); without it a remote-prefill request fetches them here, as the offline API does.
        `tenant` and `tier`: who asked, for the tiers' guaranteed slots and fair shares (EngineConfig.tier_shares)."""
        # The request's own copy: the engine fills defaults in it (max_tokens), and the caller's object may be
        # shared by other prompts and requests.
        params = copy.copy(params or SamplingParams())
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        text, ids = self.tokenize(prompt)
        self._check_token_ids(params)
        try:
            self.kv_compressor.admit(params)
        except ValueError as e:
            raise RequestError(str(e)) from None
        adapter = self._adapter(params)
        grammar = None
        if params.structured_outputs is not None:  # a cache hit when the server compiled it already
            try:
                grammar = self.grammars.compile(params.structured_outputs)
            except GrammarError as e:
                raise RequestError(str(e)) from e
        max_len = self.config.max_model_len
        if params.max_tokens is None:
            params.max_tokens = max(1, max_len - len(ids))
        total = len(ids) + params.max_tokens
        if total > max_len:
            raise RequestError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {total} tokens "
                f"exceeds the maximum context length of {max_len} tokens"
            )
        capacity = self.block_manager.num_blocks * self.config.block_size
        if total > capacity:
            raise RequestError(
                f"prompt + max_tokens = {total} tokens can never fit in the KV cache ({capacity} tokens); "
                "give the cache more memory or ask for fewer tokens"
            )
        req = Request(request_id, text, ids, params, priority, RequestMetrics(arrival_time=time.monotonic()),
                      tenant=tenant, tier=tier, lora=adapter)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None]  # the first prompt token has nothing before it to be scored by
        if params.pooling is not None:
            req.pooler = Pooler(params.pooling, len(ids))
        order = next(self._arrivals)
        for i in range(params.n):
            seq = Sequence(request=req, index=i, arrival_order=order, token_ids=list(ids), seed=params.seed,
                           grammar=grammar.matcher() if grammar is not None else None,
                           query_stats=self.kv_compressor.query_stats(params))
            init_offsets(seq)
            req.seqs.append(seq)
        if params.kv_transfer_params is not None:
            self._kv_transfer(req, ids, params.kv_transfer_params, kv_fetch)
        elif self.kv_tiers is not None and not params.whole_prompt:  # a tier's blocks beyond the pool's, into the
            # prefix cache (a request scoring its prompt computes it whole: nothing to load)
            fetched = kv_fetch if kv_fetch is not None else self.kv_tiers.fetch(ids, params.cache_salt)
            loaded = self.kv_tiers.admit(ids, fetched, params.cache_salt)
            if loaded:
                req.kv_tier_tokens[fetched.tier] = loaded
        # Choice 0 computes the prompt; the others fork from it when its last chunk runs (see the scheduler).
        self.scheduler.add(req.seqs[0])
        req.unforked = req.seqs[1:]
        self.requests[request_id] = req

    def _adapter(self, params: SamplingParams):
        """A request's LoRA adapter (None: the base model); its params' cache_salt becomes the adapter's namespace."""
        if params.lora_request is None:
            return None
        try:
            params.cache_salt = self.cache_salt(params)
            return self.lora.get(params.lora_request.lora_name)
        except LoRAError as e:
            raise RequestError(str(e)) from None

    def queue_estimate(self, request_id: str) -> QueueEstimate | None:
        """Where a request stands: the requests ahead of it, and the seconds until it starts and until its first
        token (sieve/queue_eta.py); None once it is gone."""
        req = self.requests.get(request_id)
        if req is None or not req.seqs:
            return None
        seq, sched = req.seqs[0], self.scheduler
        if seq not in sched.waiting:
            return QueueEstimate(0, 0.0, None)
        bs = self.config.block_size
        return self.queue_eta.estimate(seq, sched.waiting, sched.running,
                                       lambda s: len(self.block_manager.cached_prefix_blocks(s)) * bs, sched.token_budget())

    def check_kv_transfer(self, params: dict | None) -> bool:
        """Whether `params` (a request's kv_transfer_params) ask this engine to fetch a remote prefill; RequestError when
        they ask for what it does not do."""
        if params is None:
            return False
        if not isinstance(params, dict):
            raise RequestError("kv_transfer_params must be an object")
        conn = self.kv_connector
        if conn is None:
            raise RequestError("kv_transfer_params: this server does no KV transfer (start it with --role prefill, decode or both)")
        if params.get("do_remote_decode") and not conn.cfg.produces:
            raise RequestError("kv_transfer_params.do_remote_decode: this server is a decode server (--role decode)")
        if params.get("do_remote_prefill") and not conn.cfg.consumes:
            raise RequestError("kv_transfer_params.do_remote_prefill: this server is a prefill server (--role prefill)")
        return bool(params.get("do_remote_prefill"))

    def fetch_tiers(self, ids: list[int], salt: str | None):
        """The KV tiers' blocks for one prompt (any thread: it reads the prefix cache's index, changes nothing), for
        `add_request(kv_fetch=...)`; None without tiers."""
        return self.kv_tiers.fetch(ids, salt) if self.kv_tiers is not None else None

    def fetch_kv(self, ids: list[int], params: dict):
        """A decode server's transfer for one prompt (any thread: it touches no engine state); RequestError naming
        kv_transfer_params when they may not be acted on."""
        from sieve.distributed.kv_transfer import KVParamsError

        try:
            return self.kv_connector.fetch(ids, params)
        except KVParamsError as e:
            raise RequestError(f"kv_transfer_params: {e}") from None

    def _kv_transfer(self, req: Request, ids: list[int], params: dict | None, fetched) -> None:
        """A prefill server marks the request for export; a decode server enters its prompt's fetched blocks, so the
        scheduler finds them as a prefix-cache hit (a failed transfer leaves them to compute here)."""
        from sieve.distributed.kv_transfer import StoreFull

        if params is None:
            return
        self.check_kv_transfer(params)
        if params.get("do_remote_decode"):
            try:
                self.kv_connector.check_export()
            except StoreFull as e:
                raise ServerBusy(f"kv_transfer_params.do_remote_decode: {e}") from None
            req.kv_export = True
        if params.get("do_remote_prefill"):
            fetched = fetched if fetched is not None else self.fetch_kv(ids, params)
            req.num_transferred_tokens = self.kv_connector.admit(ids, fetched, req.params.cache_salt)

    def _check_token_ids(self, params: SamplingParams) -> None:
        """What depends on the model: token ids inside the vocabulary, top-N within --max-logprobs."""
        vocab = self.arch.vocab_size
        for name, ids in (("logit_bias", params.logit_bias or {}), ("stop_token_ids", params.stop_token_ids)):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise RequestError(f"{name} token id {bad[0]} is out of range for vocabulary size {vocab}")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(params, name)
            if n is not None and n > min(self.config.max_logprobs, vocab):
                raise RequestError(f"{name} = {n} is over this engine's limit of {min(self.config.max_logprobs, vocab)} "
                                   "(--max-logprobs)")

    def abort(self, request_id: str, reason: str = "abort") -> RequestOutput | None:
        """Stop a request now and free its blocks. Returns its final output (finish_reason `reason`)."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        for seq in req.seqs:
            if not seq.is_finished:
                seq.finish_reason = seq.finish_reason or reason
                self.scheduler.remove(seq)
                if self.speculator is not None:
                    self.speculator.finish(seq)
        return self.output_processor.make_output(req)

    def stats(self) -> EngineStats:
        """A snapshot of the engine's counters (what /metrics reports)."""
        bm, st, g = self.block_manager, self.structured_stats, self.grammars
        spec = kv = None
        if self.speculator is not None:
            s = self.speculator.stats
            spec = SpecDecodeStats(s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, tuple(s.accepted_per_pos))
        if self.kv_connector is not None:
            t = self.kv_connector.stats
            kv = KVTransferStats(dict(t.bytes), dict(t.blocks), dict(t.seconds), dict(t.fallbacks), dict(t.refused))
        return EngineStats(self.num_running, self.num_waiting, bm.usage, bm.num_queried_tokens, bm.num_hit_tokens, bm.hit_rate,
                           bm.num_cached_blocks,
                           StructuredStats(st.mask_seconds, st.num_masked_steps, st.num_masked_rows, g.num_compiled, g.num_cache_hits,
                                           g.compile_seconds), spec, kv, self.kv_tiers.snapshot() if self.kv_tiers is not None else None,
                           self.kv_compressor.snapshot(), self._lora_stats())

    def _lora_stats(self) -> LoRAStats | None:
        """The adapters of running and waiting requests (any thread: copies of the queues), and the manager's counts."""
        if self.lora is None:
            return None
        names = lambda seqs: tuple(sorted({s.request.lora.name for s in list(seqs) if s.request.lora is not None}))  # noqa: E731
        m = self.lora
        return LoRAStats(names(self.scheduler.running), names(self.scheduler.waiting), m.max_loras, len(m.names),
                         len(m.loaded), m.num_loads)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Requests with a sequence waiting (a request of n choices counts once, as vLLM's metric does)."""
        return len({seq.request.request_id for seq in self.scheduler.waiting})

    def num_waiting_in(self, tier: str) -> int:
        """Requests of `tier` (a tenants file's) with a sequence waiting."""
        return len({seq.request.request_id for seq in list(self.scheduler.waiting) if seq.request.tier == tier})

    def score(self, token_ids: list[int], chunk: int | None = None) -> torch.Tensor:
        """Logits [T, vocab] (float32) at every position of `token_ids`, for evaluation. Runs between
        steps on blocks borrowed from the pool; `chunk` splits the prefill so later chunks read the
        earlier ones through the (possibly quantized) KV cache, as serving does."""
        from sieve.model_runner import score_logits

        with self._borrowed_blocks(len(token_ids)) as table:
            step = chunk or len(token_ids)
            return torch.cat([score_logits(self.runner, token_ids, s, min(s + step, len(token_ids)), table)
                              for s in range(0, len(token_ids), step)])

    def hidden_states(self, token_ids: list[int], aux_layers: tuple[int, ...] = ()) -> torch.Tensor:
        """The model's last hidden states [T, hidden] at every position of `token_ids` (what its LM head reads),
        computed between steps on borrowed blocks: what `sieve distill` trains speculative heads on. With
        `aux_layers`, the residual stream after those layers follows ([T, (1 + len(aux_layers)) * hidden])."""
        from sieve.model_runner import score_hidden

        with self._borrowed_blocks(len(token_ids)) as table:
            return score_hidden(self.runner, token_ids, 0, len(token_ids), table, aux_layers)

    def check_alive(self, wait_s: float = 0.0) -> None:
        """EngineDead when a tensor-parallel rank this engine started is gone (waiting up to `wait_s` to see it gone):
        no later step can succeed."""
        gone = self.tp_workers.gone(wait_s) if self.tp_workers is not None else None
        if gone:
            raise EngineDead(gone)

    # ---- one iteration ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        refused = self._refuse_late() if self.config.slo_reject else []
        # KV compression: the press on every prompt the last step completed, whose first token is out already (a
        # press that failed fails its request)
        refused += [self.abort(seq.request.request_id) for seq in self.kv_compressor.press_pending(self.scheduler.running)]
        started = time.perf_counter()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return refused
        keys = decode_keys(sched)
        try:
            result = self.runner.execute(sched)
        except Exception as e:  # the requests of this step are lost; the rest of the engine is intact...
            self.scheduler.discard_forks(sched)
            failed = list(dict.fromkeys(item.seq.request.request_id for item in sched.scheduled))
            for rid in failed:
                self.abort(rid)
            self.check_alive(wait_s=1.0)  # ...unless a rank it needs is gone (named, with the error it reported)
            raise StepFailed(failed, e) from e
        self.num_steps += 1
        if self.kv_premise is not None:  # the pool at its fullest: the step's blocks held, none freed yet
            self.kv_premise.observe(self.block_manager.usage)
        for seq, first, dicts in result.prompt_logprobs:
            scored = seq.request.prompt_logprobs
            if first == len(scored):  # a sibling in the same step may have scored the same positions
                scored += dicts
        now = time.monotonic()
        touched: dict[str, Request] = {}
        finished: list[Sequence] = []
        drafted = {item.seq: item for item in sched.scheduled if item.draft}
        for seq, tokens, logprobs in result.sampled:
            req = seq.request
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            if req.params.max_tokens == 0:  # it asked only about its prompt: done once the prompt is computed
                seq.finish_reason = "length"
            else:
                appended = 0
                for token_id, lp in zip(tokens, logprobs):  # stops at the first token that ends the sequence
                    self.output_processor.append_token(seq, token_id, lp)
                    appended += 1
                    if seq.grammar is not None:  # a complete structured output ends it too
                        self._advance_grammar(seq, token_id)
                    if seq.finish_reason is not None:
                        break
                item = drafted.get(seq)
                if item is not None:
                    # Drafts accepted by verification (the metric), and those now part of the sequence (their K/V stays).
                    self.speculator.record(seq, len(item.draft), len(tokens) - 1, sum(len(b.draft) for b in item.branches),
                                           item.chain_accepted)
                    item.num_accepted = appended - 1
            if seq.finish_reason is not None:
                finished.append(seq)
            touched[req.request_id] = req
        if result.num_masked_rows:
            st = self.structured_stats
            st.mask_seconds += result.mask_seconds
            st.num_masked_steps += 1
            st.num_masked_rows += result.num_masked_rows
        if result.hidden:
            self.speculator.observe_hidden(result.hidden)
        self._settle(sched, finished, touched)
        outputs = []
        for req in touched.values():
            out = self.output_processor.make_output(req)
            if out.finished and req.kv_export and self.kv_connector is not None:  # its blocks are still cached
                out.kv_transfer_params = self._export(req)
            outputs.append(out)
        self._timed(sched.num_batched_tokens, time.perf_counter() - started, keys, finished)
        if self.speculator is not None:
            self.speculator.after_step(self.scheduler.running, self._prefill_tokens_next)
        for out in outputs:  # unregistered last: whatever raised above, a failure still finds every request it must fail
            if out.finished:
                del self.requests[out.request_id]
        return refused + outputs

    def _timed(self, num_tokens: int, seconds: float, keys: int, finished: list[Sequence]) -> None:
        """The step's own time (the proposer's drafting after it is timed apart), the lengths of the sequences it
        finished, and when the head of the queue is now expected to start (a full queue's Retry-After)."""
        self.step_timer.observe(num_tokens, seconds, keys)
        for seq in finished:
            self.queue_eta.finished(seq.num_tokens - seq.num_prompt_tokens, seq.params.max_tokens)
        if self.track_queue_head:
            self._track_queue_heads()

    TIER_HEADS_EVERY_S = 0.5  # a tier's first waiting request may be deep in the queue: its simulation costs more

    def _track_queue_heads(self) -> None:
        """When the head of the queue is now expected to start, and, at most every TIER_HEADS_EVERY_S, each tier's
        first waiting request (a Retry-After is in whole seconds)."""
        waiting, budget = self.scheduler.waiting, self.scheduler.token_budget()

        def start_s(seq) -> float:
            return self.queue_eta.estimate(seq, waiting, self.scheduler.running, lambda s: 0, budget).start_s

        self.queue_head_eta_s = start_s(waiting[0]) if waiting else 0.0
        now = time.monotonic()
        if now - self._tier_heads_at < self.TIER_HEADS_EVERY_S:
            return
        self._tier_heads_at = now
        heads = {}
        for seq in waiting:
            if seq.request.tier is not None:
                heads.setdefault(seq.request.tier, seq)
        self.tier_head_eta_s = {tier: start_s(seq) for tier, seq in heads.items()}

    def _settle(self, sched, finished: list[Sequence], touched: dict[str, Request]) -> None:
        """After a step's tokens are appended: the scheduler's accounting, the KV tiers' writes, and the finished
        sequences out (with their blocks)."""
        self.scheduler.postprocess(sched)  # before removal: a finished sequence's full blocks still enter the cache
        if self.kv_tiers is not None:  # written down off this thread, as they enter the cache
            self.kv_tiers.written(self.block_manager.take_new_cached())
        for seq in finished:
            self.scheduler.remove(seq)
            if self.speculator is not None:
                self.speculator.finish(seq)

    def _refuse_late(self) -> list[RequestOutput]:
        """--slo-reject: finish every request still waiting for its first step whose TTFT objective can no longer be
        met: its wait so far and its own prompt's predicted time are past it. Refused now, its client can go
        elsewhere at once; served late, it would also have delayed those behind it. Each output carries
        `retry_after_s`: the objective's length (by then this queue has turned over)."""
        limit = self.config.slo_ttft_ms / 1e3
        now = time.monotonic()
        late = []
        for seq in self.scheduler.waiting:
            m = seq.request.metrics
            if m.first_scheduled_time is not None:  # it started (and was preempted since): it is finished, not refused
                continue
            own = self.step_cost.predict(seq.num_tokens) if self.step_cost.ready else 0.0
            if now - m.arrival_time + own > limit:
                late.append(seq.request.request_id)
        outputs = []
        for rid in dict.fromkeys(late):
            out = self.abort(rid, reason="slo_unmet")
            out.retry_after_s = limit
            outputs.append(out)
        if outputs:
            log.warning("refused %d requests whose time to first token could no longer be met (--slo-reject)", len(outputs))
        return outputs

    def _export(self, req: Request) -> dict | None:
        """A prefill server's finished request: its blocks saved for a decode server. An export that fails (a full
        shared-memory disk, say) leaves the answer without params, and the decode server computes the prompt."""
        try:
            return self.kv_connector.save(req.seqs[0])
        except Exception as e:  # noqa: BLE001
            log.error("request %s: its KV could not be exported (%s: %s)", req.request_id, type(e).__name__, e)
            self.kv_connector.stats.refused["export failed"] += 1
            return None

    @staticmethod
    def _advance_grammar(seq: Sequence, token_id: int) -> None:
        """Structured outputs: the grammar takes an appended token; a complete output ends the sequence."""
        if not seq.grammar.accept([token_id]):  # cannot happen (the mask allowed every one): fail the choice loudly
            log.error("request %s: a generated token broke its grammar: %s", seq.request.request_id, seq.grammar.error)
            seq.finish_reason = seq.finish_reason or "abort"
        elif seq.finish_reason is None and seq.grammar.is_terminated:
            seq.finish_reason = "stop"

    def _prefill_tokens_next(self) -> int:
        """Prompt tokens the next step will likely compute besides decodes (for the depth controller)."""
        pending = sum(s.num_tokens - s.num_computed_tokens for s in self.scheduler.running
                      if s.num_tokens - s.num_computed_tokens > 1)
        if len(self.scheduler.running) < self.config.max_num_seqs:
            pending += sum(s.num_tokens for s in self.scheduler.waiting[:4])
        return min(pending, self.scheduler.token_budget())


def _load_tokenizer(name: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)
