"""sieve: an LLM inference engine that attacks bytes moved per generated token."""

from sieve.config import EngineConfig
from sieve.engine import LLMEngine, RequestError
from sieve.llm import LLM
from sieve.outputs import CompletionOutput, Logprob, RequestOutput
from sieve.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "RequestError"]
__version__ = "0.1.0"
