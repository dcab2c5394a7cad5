"""Calibration for the quantizers that search scales on text (AWQ, SmoothQuant): the reference model in
`transformers`, the text cut into windows, and the inputs of chosen modules captured as it runs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import torch


def windows(tok, texts: list[str], seq_len: int, max_windows: int) -> list[torch.Tensor]:
    """The texts joined and tokenized, cut into at most `max_windows` windows of `seq_len` tokens."""
    ids = tok("\n\n".join(texts), return_tensors="pt").input_ids[0]
    return [ids[i : i + seq_len] for i in range(0, max(1, len(ids) - seq_len + 1), seq_len)][:max_windows]


@torch.no_grad()
def capture_inputs(model, wins: list[torch.Tensor], targets: dict, on_input: Callable[[object, torch.Tensor], None]) -> None:
    """Run the model on each window, calling on_input(key, x) with each target module's input as float32 [T, K]."""
    hooks = [m.register_forward_hook(lambda mod, inp, out, key=key: on_input(key, inp[0].reshape(-1, inp[0].shape[-1]).float()))
             for key, m in targets.items()]
    try:
        for w in wins:
            model(w[None])
    finally:
        for h in hooks:
            h.remove()


def reference_model(model_path: Path):
    """(transformers model in float32, tokenizer, config.json dict, function saving the tokenizer files)
    for a Hugging Face folder or a GGUF file. A GGUF file's weights come dequantized through sieve's own
    reader (q/k rows in Hugging Face order, its config) into a model built from that config."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from sieve.models.gguf import GGUFCheckpoint, find_gguf

    gguf_file = find_gguf(model_path)
    if gguf_file is None:
        def copy_tokenizer(out: Path) -> None:
            for f in model_path.iterdir():
                if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
                    shutil.copy(f, out / f.name)

        return (AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(model_path),
                json.loads((model_path / "config.json").read_text()), copy_tokenizer)
    ckpt = GGUFCheckpoint(gguf_file, dequantize=True)
    cfg = dict(ckpt.config, torch_dtype="float32")
    if (cfg.get("rope_scaling") or {}).get("rope_type") == "freq_factors":
        raise ValueError(f"{gguf_file}: calibration runs in transformers, whose configs cannot express this file's rope_freqs")
    config = AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k not in ("model_type", "architectures")})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict({name: t.float() for name, t in ckpt.tensors()}, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise ValueError(f"{gguf_file}: its tensors do not fit {cfg['architectures'][0]} (missing {missing[:3]}, unexpected {unexpected[:3]})")
    model.tie_weights()
    tok = ckpt.tokenizer()
    return model.eval(), tok, cfg, lambda out: tok.save_pretrained(str(out))
