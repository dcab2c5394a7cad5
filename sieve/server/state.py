"""What every route of the server shares (`app.state.sieve`): the engine and its thread, the tokenizer and its pool,
the limits and the keys; and the checks a request passes before the engine sees it (model name, sizes, sampling
parameters, the grammar compile, the tenant's cache salt)."""

from __future__ import annotations

import asyncio
import hmac
import math
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from fastapi import Request

from sieve.engine import ServerBusy
from sieve.lora import LoRAError, LoRARequest
from sieve.server.async_engine import AsyncEngine, EngineError
from sieve.server.auth import APIKeys
from sieve.server.errors import APIError
from sieve.server.metrics import Metrics
from sieve.server.response_store import ResponseStore
from sieve.server.tenants import OTHER, TIER_STRIDE, Limited, TenantLimiter, Tenants
from sieve.server.tools import render_messages
from sieve.structured import GrammarError
from sieve.tenancy import BACKGROUND

BATCH_PRIORITY = BACKGROUND  # below every tier's (tier x TIER_STRIDE + the client's own): in the capacity left


@dataclass
class ServerLimits:
    """What one request may ask for (each a `sieve serve` flag): stop strings are scanned on every token and held back
    from streams by the longest one, logit_bias is applied every step, an unread stream holds every output, a grammar
    compiles on a shared pool."""

    max_stop_strings: int = 32
    max_stop_string_chars: int = 256
    max_logit_bias: int = 1024
    max_prompt_bytes: int | None = None  # default: the prompt token limit x the vocabulary's longest token
    max_stream_backlog: int = 256
    grammar_workers: int = 2

    def __post_init__(self) -> None:
        for name in ("max_stop_strings", "max_stop_string_chars", "max_logit_bias", "max_stream_backlog", "grammar_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")


@dataclass
class ServerOptions:
    """`create_app`'s settings (see its docstring)."""

    served_model_name: str | None = None
    max_waiting: int | None = None
    allow_client_priority: bool = False
    metrics_public: bool = False
    health_stall_seconds: float = 60.0
    max_n: int = 128
    max_prompts: int = 64
    max_body_bytes: int = 16 << 20
    max_prompt_tokens: int | None = None
    tokenizer_workers: int = 1
    grammar_timeout: float = 10.0
    webui: bool = True
    limits: ServerLimits | None = None
    shared_prefix_cache: bool = False
    tenants: Tenants | None = None  # --tenants: tiers, limits and keys per tenant
    embedding_pooling: str = "mean"  # /v1/embeddings: "mean" or "last" (sieve/pooling.py)
    max_stored_responses: int = 1000  # the Responses API's store (in memory)
    lora_dir: str | None = None  # --lora-dir: the folder /v1/load_lora_adapter may read adapters from (None: none)


def longest_token_bytes(tokenizer) -> int:
    """The most bytes one token of this vocabulary stands for (at least 1; 32 without a tokenizer)."""
    if tokenizer is None:
        return 32
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # noqa: BLE001 (a tokenizer without a vocabulary listing)
        return 64
    return max(1, max((len(t.encode("utf-8", "surrogatepass")) for t in vocab), default=1))


class ServerState:
    def __init__(self, aengine: AsyncEngine, keys: APIKeys, options: ServerOptions):
        self.aengine, self.engine, self.keys, self.options = aengine, aengine.engine, keys, options
        self.limits = options.limits or ServerLimits()
        self.tokenizer = self.engine.tokenizer
        self.model_name = options.served_model_name or self.engine.model_name
        self.metrics = Metrics(self.engine, self.model_name)
        self.tokenize_pool = ThreadPoolExecutor(max_workers=options.tokenizer_workers, thread_name_prefix="sieve-tokenize")
        # structured-output grammars compile here, each within its own deadline (time queued behind others does not count)
        self.grammar_pool = ThreadPoolExecutor(max_workers=self.limits.grammar_workers, thread_name_prefix="sieve-grammar")
        self.prompt_token_limit = options.max_prompt_tokens or self.engine.config.max_model_len
        # A prompt of more bytes than the limit's tokens could ever hold is refused before it is tokenized
        self.prompt_byte_limit = self.limits.max_prompt_bytes or self.prompt_token_limit * longest_token_bytes(self.tokenizer)
        self.salted = keys.num_tenants > 1 and not options.shared_prefix_cache  # each tenant's prefix cache apart
        self.report_cached = keys.num_tenants <= 1 or self.salted  # a shared cache's hit may be another tenant's: not reported
        self.tenants = options.tenants
        self.internal_secret = secrets.token_hex(32)  # the Batch API runner's requests (sieve/server/batch_runner.py)
        self.batches = None  # its store (BatchStore), with --batch-dir
        self.responses = ResponseStore(options.max_stored_responses)  # the Responses API's stored responses
        self.limiter = TenantLimiter(options.tenants) if options.tenants is not None else None
        self._tenant_of_request: dict[str, str] = {}  # engine request id -> tenant (its finish is counted for it)
        self._batch_of_request: dict[str, str] = {}  # engine request id -> the tenant whose batch it is

    def tenant_of(self, request: Request) -> None:
        """The request's tenant, by its key (compared in constant time: no timing oracle on the key); 401 without one.
        The Batch API's runner sends its tenants' requests with this process's own secret (never sent out)."""
        internal = request.headers.get("x-sieve-internal")
        request.state.batch = internal is not None and hmac.compare_digest(internal.encode(), self.internal_secret.encode())
        if request.state.batch:
            request.state.tenant = request.headers.get("x-sieve-tenant", "")
            return
        key = request.headers.get("x-api-key")  # Anthropic's clients send the key there
        authorization = request.headers.get("authorization") or (f"Bearer {key}" if key is not None else None)
        request.state.tenant = self.keys.tenant(authorization) if self.keys.enabled else ""
        if request.state.tenant is None:
            raise APIError(401, "invalid or missing API key", "authentication_error", code="invalid_api_key")

    def tenant_salt(self, request: Request, params) -> None:
        """With several tenants, a request's blocks are named under its tenant (and its own cache_salt, if any); a
        tenant whose --tenants entry says share_prefix_cache shares them with the others that say so."""
        if self.salted and not self.shares_cache(request):
            params.cache_salt = f"tenant:{request.state.tenant}" + (f"|{params.cache_salt}" if params.cache_salt else "")

    def shares_cache(self, request: Request) -> bool:
        tenant = self.tenants.tenant(request.state.tenant) if self.tenants is not None else None
        return tenant is not None and tenant.share_prefix_cache

    def reports_cached(self, request: Request) -> bool:
        """Whether usage may say how many prompt tokens were cached (not where a hit may be another tenant's)."""
        return self.report_cached and not self.shares_cache(request)

    def priority(self, request: Request, client_priority: int) -> int:
        """The engine priority: the tenant's tier first (--tenants), then the client's own (--allow-client-priority);
        a batch request's is below every tier's."""
        if request.state.batch:
            return BATCH_PRIORITY
        tenant = self.tenants.tenant(request.state.tenant) if self.tenants is not None else None
        if tenant is None:
            return client_priority
        return tenant.tier.priority * TIER_STRIDE + max(-TIER_STRIDE // 2 + 1, min(TIER_STRIDE // 2 - 1, client_priority))

    def tenancy(self, request: Request) -> tuple[str | None, str | None]:
        """(tenant, tier) for the engine's fair shares and guaranteed slots."""
        tenant = self.tenants.tenant(request.state.tenant) if self.tenants is not None else None
        tier = "batch" if request.state.batch else tenant.tier.name if tenant is not None else None
        return (request.state.tenant or None, tier)

    def admit_tenant(self, request: Request, request_ids: list[str], prompt_tokens: int) -> bool:
        """Count the request against its tenant's limits (429 with Retry-After past one); True when the caller must
        `release_tenant` it once it is over. A batch request is counted in the batch metrics under its batch's tenant,
        never against its limits (it runs only in capacity others leave)."""
        if request.state.batch:
            for rid in request_ids:
                self._batch_of_request[rid] = request.state.tenant
            return False
        if self.limiter is None:
            return False
        name = request.state.tenant
        try:
            self.limiter.admit(name, prompt_tokens)
        except Limited as e:
            self.metrics.tenant_refused(self.tenants.label(name), e.limit)
            raise APIError(429, f"{e}; retry after Retry-After seconds", "rate_limit_exceeded", code=e.limit,
                           headers={"Retry-After": str(max(1, math.ceil(e.retry_after_s)))}) from None
        for rid in request_ids:  # (until the engine thread reports it finished: an abort's report may come later)
            self._tenant_of_request[rid] = name
        return True

    def release_tenant(self, request: Request) -> None:
        self.limiter.release(request.state.tenant)

    def finished(self, out) -> None:
        """The engine thread's hook for each finished request: its metrics, and its generated tokens counted against
        its tenant's tokens per minute."""
        batch = self._batch_of_request.pop(out.request_id, None)
        if batch is not None:
            self.metrics.record_batch_finished(out, self.tenants.label(batch) if self.tenants is not None else OTHER)
            return
        name = self._tenant_of_request.pop(out.request_id, None)
        label = self.tenants.label(name) if self.tenants is not None else None
        self.metrics.record_finished(out, label)
        if name is not None:
            self.limiter.count_generated(name, sum(len(c.token_ids) for c in out.outputs))

    def check_model(self, name: str | None) -> None:
        """The base model's name, or one of its LoRA adapters' (--enable-lora); a 404 otherwise."""
        if name is None or name == self.model_name or name in self.adapter_names():
            return
        raise APIError(404, f"the model `{name}` does not exist; this server serves `{self.model_name}`" +
                       (f" and its adapters {', '.join(self.adapter_names())}" if self.adapter_names() else ""),
                       code="model_not_found", param="model")

    def adapter_names(self) -> list[str]:
        return self.engine.lora.names if self.engine.lora is not None else []

    def lora_request(self, name: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model)."""
        if name is None or name == self.model_name or self.engine.lora is None:
            return None
        return LoRARequest(name, 0, "")  # a registered adapter, by name: the engine reads no path a request gives

    def check_tokenizer(self) -> None:
        if self.tokenizer is None:
            raise APIError(400, "this server has no tokenizer")

    async def off_loop(self, fn, *args):
        """Run `fn` on the tokenizer pool: tokenizing a long prompt or rendering a template blocks no one."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, fn, *args)

    def check_length(self, ids: list[int]) -> None:
        if len(ids) > self.prompt_token_limit:
            raise APIError(400, f"the prompt is {len(ids)} tokens, over this server's limit of {self.prompt_token_limit} "
                                f"({'--max-prompt-tokens' if self.options.max_prompt_tokens else 'the context length'})",
                           param="prompt", code="context_length_exceeded")

    def check_bytes(self, texts, param: str = "prompt") -> None:
        size = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts if isinstance(t, str))
        if size > self.prompt_byte_limit:
            self.metrics.limit_refused("prompt_bytes")
            raise APIError(400, f"the prompt is {size} bytes, more than {self.prompt_byte_limit} (--max-prompt-bytes; the most "
                                f"that {self.prompt_token_limit} tokens can hold): refused before tokenizing", param=param,
                           code="context_length_exceeded")

    def encode_prompt(self, prompt):
        """A text prompt becomes token ids here (the engine then only checks them); ids pass as they are."""
        if isinstance(prompt, str) and self.tokenizer is not None:
            prompt = {"prompt_token_ids": self.tokenizer.encode(prompt), "prompt": prompt}
        if isinstance(prompt, dict):
            self.check_length(prompt["prompt_token_ids"])
        return prompt

    def render_chat(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None) -> dict:
        try:
            messages, extra = render_messages(messages, tools, self.tokenizer)
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **extra)
        except Exception as e:
            raise APIError(400, f"could not apply the chat template: {e}", param="messages") from e
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        self.check_length(ids)
        return {"prompt_token_ids": ids, "prompt": text}

    async def compile_grammar(self, params, param: str | None = None) -> None:
        """Structured outputs: compile the request's grammar off the event loop and the engine thread (cached by its
        hash, so the engine only copies it) on a pool of --structured-outputs-compile-workers threads, within
        --structured-outputs-compile-timeout counted from when its compile starts (not while it waits behind others);
        the compile itself is bounded by the same deadline (llguidance's fuel), so it ends rather than holding its
        thread. A grammar that cannot compile, or not in time, is a 400."""
        spec = params.structured_outputs
        if spec is None:
            return
        param, timeout = param or "response_format", self.options.grammar_timeout
        started = asyncio.Event()
        loop = asyncio.get_running_loop()

        def compile_now():
            loop.call_soon_threadsafe(started.set)
            return self.engine.grammars.compile(spec, deadline_s=timeout)

        future = loop.run_in_executor(self.grammar_pool, compile_now)
        try:
            await asyncio.wait({future, asyncio.ensure_future(started.wait())}, return_when=asyncio.FIRST_COMPLETED)
            await asyncio.wait_for(asyncio.shield(future), timeout)
        except asyncio.TimeoutError:
            self.metrics.limit_refused("grammar_timeout")
            raise APIError(400, f"the {spec.kind} constraint did not compile within {timeout:g} s "
                                "(--structured-outputs-compile-timeout)", param=param, code="grammar_timeout") from None
        except GrammarError as e:
            raise APIError(400, str(e), param=param, code="invalid_grammar") from e

    def sampling_params(self, body, max_tokens, logprobs, prompt_logprobs):
        """The request's SamplingParams, once its fields pass this server's limits (a 400 naming the field otherwise)."""
        field = body.unsupported()
        if field is not None:
            raise APIError(400, f"`{field}` is not supported by this server", param=field, code="unsupported_field")
        broken = body.invalid()
        if broken is not None:
            raise APIError(400, broken[1], param=broken[0])
        if body.n > self.options.max_n:
            raise APIError(400, f"n = {body.n} is over this server's limit of {self.options.max_n} choices (--max-n)", param="n")
        self._check_kv_transfer(body)
        self._check_limits(body)
        if "priority" in body.model_fields_set and not self.options.allow_client_priority:
            raise APIError(400, "`priority` is honoured only when the server runs with --allow-client-priority", param="priority",
                           code="unsupported_field")
        try:
            params = body.sampling_params(max_tokens, logprobs, prompt_logprobs)
            params.lora_request = self.lora_request(body.model)
            return params
        except ValueError as e:
            raise APIError(400, str(e), param="kv_compression" if str(e).startswith("kv_compression") else None) from e

    @staticmethod
    def _check_kv_transfer(body) -> None:
        kv = body.kv_transfer_params
        if not isinstance(kv, dict):
            return
        if kv.get("do_remote_prefill") and isinstance(getattr(body, "prompt", None), list) and len(body.prompts()) > 1:
            raise APIError(400, "kv_transfer_params.do_remote_prefill carries one prompt's KV: send one prompt",
                           param="kv_transfer_params")
        if body.stream and kv.get("do_remote_decode"):
            raise APIError(400, "kv_transfer_params.do_remote_decode answers with the params a decode server needs: "
                           "it needs stream false", param="kv_transfer_params")

    def _check_limits(self, body) -> None:
        limits = self.limits
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stops) > limits.max_stop_strings or any(len(x) > limits.max_stop_string_chars for x in stops):
            self.metrics.limit_refused("stop")
            raise APIError(400, f"stop takes at most {limits.max_stop_strings} strings of at most {limits.max_stop_string_chars} "
                                "characters (--max-stop-strings, --max-stop-string-chars)", param="stop")
        if len(body.logit_bias or {}) > limits.max_logit_bias:
            self.metrics.limit_refused("logit_bias")
            raise APIError(400, f"logit_bias takes at most {limits.max_logit_bias} tokens (--max-logit-bias)", param="logit_bias")

    async def ready_adapter(self, params) -> None:
        """A request's adapter in memory before it reaches the engine (read from its folder here, off the engine
        thread, if it was dropped); a 404 if it was unloaded meanwhile."""
        if params.lora_request is None:
            return
        try:
            await self.off_loop(self.engine.lora.get, params.lora_request.lora_name)
        except LoRAError as e:
            raise APIError(404, str(e), code="model_not_found", param="model") from None

    def check_capacity(self, request: Request) -> None:
        """429 `queue_full` where --max-waiting requests wait, or the request's tier's `max_waiting` of its own
        (--tenants); Retry-After: when the head of that queue is expected to start. Batch requests wait elsewhere."""
        if request.state.batch:
            return
        max_waiting = self.options.max_waiting
        if max_waiting is not None and self.engine.num_waiting + self.aengine.num_pending >= max_waiting:
            self.metrics.rejected.inc()
            raise queue_full(f"the server is at capacity ({max_waiting} requests waiting)", self.engine.queue_head_eta_s)
        tenant = self.tenants.tenant(request.state.tenant) if self.tenants is not None else None
        tier = tenant.tier if tenant is not None else None
        if tier is not None and tier.max_waiting is not None and \
                self.engine.num_waiting_in(tier.name) + self.aengine.num_pending_in(tier.name) >= tier.max_waiting:
            self.metrics.rejected.inc()
            self.metrics.tenant_refused(self.tenants.label(request.state.tenant), "max_waiting")
            raise queue_full(f"the {tier.name} tier is at capacity ({tier.max_waiting} of its requests waiting)",
                             self.engine.tier_head_eta_s.get(tier.name))

    def slo_unmet(self, retry_after_s: float) -> APIError:
        """--slo-reject: the request waited until its time-to-first-token objective could no longer be met."""
        self.metrics.rejected.inc()
        return APIError(429, f"the server could not start this request within its time-to-first-token objective "
                             f"({self.engine.config.slo_ttft_ms:g} ms, --slo-ttft-ms); retry after Retry-After seconds",
                        "rate_limit_exceeded", code="slo_unmet", headers={"Retry-After": str(max(1, math.ceil(retry_after_s)))})

    def as_api_error(self, e: Exception) -> APIError:
        if isinstance(e, EngineError):
            return APIError(503 if self.aengine.error is not None else 500, str(e), "server_error", code="engine_error")
        if isinstance(e, ServerBusy):
            return APIError(503, str(e), "server_error", code="server_busy", headers={"Retry-After": "1"})
        message = str(e)
        param = "kv_transfer_params" if message.startswith("kv_transfer_params") else \
            "kv_compression" if message.startswith("kv_compression") else \
            "prompt" if "prompt" in message or "context" in message else None
        return APIError(400, message, param=param)


def queue_full(message: str, head_eta_s: float | None) -> APIError:
    return APIError(429, message + "; retry after Retry-After seconds", "rate_limit_exceeded", code="queue_full",
                    headers={"Retry-After": str(max(1, math.ceil(head_eta_s or 1)))})
