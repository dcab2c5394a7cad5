"""A trained draft's folder, as `sieve distill` writes it and a proposer reads it: config.json (its `method`, its
sizes, what training measured) beside one safetensors file of weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch

CONFIG = "config.json"


def save_folder(module: torch.nn.Module, out: str | Path, weights: str, config: dict) -> None:
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in module.state_dict().items()}, str(out / weights))
    (out / CONFIG).write_text(json.dumps(config, indent=1))


def read_config(path: str | Path, method: str, what: str, article: str = "") -> dict:
    """The folder's config; a clear error if there is none, or if it holds another method's draft."""
    path = Path(path)
    try:
        config = json.loads((path / CONFIG).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} holds no {what} ({CONFIG}: {e}); train one with `sieve distill --method {method}`") from e
    if config.get("method") != method:
        raise ValueError(f"{path} holds {config.get('method')!r} heads, not {article}{what}")
    return config
