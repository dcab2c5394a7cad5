"""sieve: an LLM inference engine that attacks bytes moved per generated token."""

from sieve.kernels import limit_torch_isa

limit_torch_isa()  # SIEVE_CPU_ISA=avx2|generic: before PyTorch's CPU kernels first run

from sieve.config import EngineConfig  # noqa: E402
from sieve.engine import LLMEngine, RequestError  # noqa: E402
from sieve.llm import LLM  # noqa: E402
from sieve.lora import LoRARequest  # noqa: E402
from sieve.outputs import CompletionOutput, Logprob, RequestOutput  # noqa: E402
from sieve.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "RequestError",
           "LoRARequest"]
__version__ = "0.1.0"
