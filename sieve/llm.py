"""The offline API, shaped like vLLM's: `LLM(model).generate(prompts, params)`."""

from __future__ import annotations

import dataclasses
import itertools

from sieve.config import EngineConfig
from sieve.engine import LLMEngine, Prompt
from sieve.lora import LoRARequest
from sieve.outputs import RequestOutput
from sieve.pooling import PoolingParams
from sieve.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, dtype: str = "auto", **kwargs):
        self.llm_engine = LLMEngine(EngineConfig(model=model, dtype=dtype, **kwargs))
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the engine's worker processes (tensor parallelism); the object cannot generate afterwards."""
        self.llm_engine.shutdown()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = False, add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict] | None = None, chat_template_kwargs: dict | None = None,
             lora_request: LoRARequest | list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: one conversation (a list of messages) or several, each through the model's chat template
        (with `tools` offered as the server offers them: in the template, or in the system prompt where it has no
        place for them), then generated as `generate` does; the outputs are the model's raw text."""
        from sieve.server.tools import render_messages  # (the template's tool rendering, shared with the server)

        tokenizer = self.llm_engine.tokenizer
        if tokenizer is None:
            raise ValueError("this model has no tokenizer, so no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conversation in conversations:
            rendered, extra = render_messages(conversation, tools, tokenizer)
            text = tokenizer.apply_chat_template(rendered, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                 continue_final_message=continue_final_message, **extra,
                                                 **(chat_template_kwargs or {}))
            prompts.append({"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False), "prompt": text})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def embed(self, prompts: Prompt | list[Prompt], pooling_params: PoolingParams | None = None,
              use_tqdm: bool = False) -> list[RequestOutput]:
        """Each prompt's embedding (`RequestOutput.embedding`): its final hidden states pooled as `pooling_params`
        says (mean over positions, normalized, by default), the prompts prefilled together in the same steps."""
        params = SamplingParams(max_tokens=0, pooling=pooling_params or PoolingParams())
        return self.generate(prompts, params, use_tqdm=use_tqdm)

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
        priority: list[int] | None = None,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; one `RequestOutput` per prompt, in input order. `lora_request`: the LoRA
        adapter every prompt runs with, or one per prompt (None: the base model), as vLLM's (enable_lora)."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        if lora_request is not None:
            loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
            if len(loras) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(loras)} LoRA requests")
            params = [dataclasses.replace(p, lora_request=lr) for p, lr in zip(params, loras)]
        engine = self.llm_engine
        ids: list[str] = []
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(prompts), desc="generate", unit="req")
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                rid = f"offline-{next(self._ids)}"
                engine.add_request(rid, prompt, p, priority=priority[i] if priority else 0)
                ids.append(rid)
            while engine.has_unfinished():
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        if bar:
                            bar.update(1)
        except BaseException:
            # A refused prompt or a failed step leaves nothing of this call behind: the object stays usable.
            for rid in ids:
                engine.abort(rid)
            raise
        finally:
            if bar:
                bar.close()
        return [results[rid] for rid in ids]

