"""The offline API, shaped like vLLM's: `LLM(model).generate(prompts, params)`."""

from __future__ import annotations

import itertools

from sieve.config import EngineConfig
from sieve.engine import LLMEngine, Prompt
from sieve.outputs import RequestOutput
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

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; one `RequestOutput` per prompt, in input order."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
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

