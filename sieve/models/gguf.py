"""GGUF checkpoints (llama.cpp's file format): hyper-parameters, tensors and tokenizer from one file.

`GGUFCheckpoint(path)` reads the file (memory-mapped: the header by sieve.models.gguf_reader, the
block formats by the `gguf` package) and gives what the loader needs in Hugging Face terms, so the
rest of sieve never sees GGUF names:
  - `config`: a `config.json`-shaped dict built from the file's metadata (architecture, sizes, rope,
    EOS ids), for llama (which is also how llama.cpp writes Mistral models), qwen2 and qwen3;
  - `tensors()`: (Hugging Face name, value) pairs. Quantized tensors keep the file's precision:
        Q8_0          -> int8 codes with a float16 scale per 32 inputs   (ChannelScaledWeight)
        Q4_0, Q4_1    -> 4-bit codes with a float16 scale and min per 32  (Int4Weight; Q4_0's min is -8 scale)
    whose `dequantize()` equals `gguf.quants.dequantize` bit for bit. F32, F16 and BF16 come as they
    are. K-quants and Q5_0/Q5_1 have no native kernel here: they are dequantized to float32 (the
    loader casts them to the model dtype) and the log names them. With `dequantize=True` every
    tensor is (the float32 reference path);
  - `tokenizer()`: transformers' conversion of the file's vocabulary (BPE or SentencePiece), cached
    after the first time (converting SmolLM2's 49k-token vocabulary takes ~7 s), with the file's chat
    template.
llama.cpp stores the q and k rows of "llama" models permuted for its interleaved rotary; they are put
back in Hugging Face order (rows only, so quantized blocks move whole).

A file that is truncated, is not GGUF, or holds an architecture or tensor type sieve does not run
raises `GGUFError`, naming what is wrong.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from sieve.models.gguf_reader import GGUFFile, StringArray
from sieve.quant.formats import ChannelScaledWeight, Int4Weight, pack_int4_pairs

log = logging.getLogger("sieve")

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "gemma3": "Gemma3ForCausalLM"}
LAYER_NAMES = {  # Hugging Face suffix -> GGUF name within blk.{i}
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}
GEMMA3_NAMES = {  # Gemma 3's four norms per layer; llama.cpp's ffn_norm is the one before the MLP
    **{k: v for k, v in LAYER_NAMES.items() if k != "post_attention_layernorm.weight"},
    "post_attention_layernorm.weight": "post_attention_norm.weight", "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
_FROM_GGUF = {v: k for k, v in TOP_NAMES.items()}
_LAYER_FROM_GGUF = {v: k for k, v in LAYER_NAMES.items()}
_GEMMA3_FROM_GGUF = {v: k for k, v in GEMMA3_NAMES.items()}
# Gemma's end of turn: llama.cpp's converter leaves it out of the file's EOS ids, transformers' generation config has it
GEMMA_END_OF_TURN = "<end_of_turn>"
# Gemma 3's chat template (transformers' tokenizer_config of google/gemma-3-*), for files that carry none
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}{%- if messages[0]['content'] is string -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- else -%}"
    "{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set first_user_prefix = \"\" -%}"
    "{%- set loop_messages = messages -%}{%- endif -%}{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}{%- endif -%}"
    "{%- if (message['role'] == 'assistant') -%}{%- set role = \"model\" -%}{%- else -%}"
    "{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- elif message['content'] is iterable -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}{%- endfor -%}"
    "{%- else -%}{{ raise_exception(\"Invalid content type\") }}{%- endif -%}"
    "{{ '<end_of_turn>\n' }}{%- endfor -%}{%- if add_generation_prompt -%}{{'<start_of_turn>model\n'}}{%- endif -%}"
)

NATIVE = ("Q8_0", "Q4_0", "Q4_1")  # kept in their format
PLAIN = ("F32", "F16", "BF16")
DEQUANTIZED = ("Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")  # widened at load, and the log says so


MAX_CONTEXT = 1 << 24  # tokens: more than any model's context (the longest are 10M)


class GGUFError(ValueError):
    """A GGUF file sieve cannot load, with the reason."""


def is_gguf(path: str | Path) -> bool:
    p = Path(path)
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == b"GGUF"


def find_gguf(path: Path) -> Path | None:
    """`path` itself if it is a GGUF file, the one GGUF file in a folder holding no Hugging Face
    checkpoint, or None."""
    if path.is_file():
        return path if path.suffix == ".gguf" or is_gguf(path) else None
    if path.is_dir() and not (path / "config.json").exists():
        files = sorted(path.glob("*.gguf"))
        if len(files) > 1:
            raise GGUFError(f"{path} holds {len(files)} GGUF files ({', '.join(f.name for f in files)}); pass one of them")
        return files[0] if files else None
    return None


class GGUFCheckpoint:
    def __init__(self, path: str | Path, dequantize: bool = False):
        self.path = Path(path)
        self.dequantize = dequantize
        try:
            self.reader = GGUFFile(self.path)
        except Exception as e:  # truncated, not GGUF, corrupt header or tensor table
            raise GGUFError(f"{self.path} is not a readable GGUF file: {type(e).__name__}: {e}") from None
        self.arch_name = self._field("general.architecture")
        if self.arch_name not in ARCHITECTURES:
            raise GGUFError(f"{self.path}: GGUF architecture {self.arch_name!r} is not supported "
                            f"(sieve runs: {', '.join(sorted(ARCHITECTURES))})")
        self._tensors = {t.name: t for t in self.reader.tensors}
        for t in self.reader.tensors:
            kind = t.tensor_type.name
            if kind not in NATIVE + PLAIN + DEQUANTIZED:
                raise GGUFError(f"{self.path}: tensor {t.name} has type {kind}, which sieve does not load "
                                f"(supported: {', '.join(NATIVE + PLAIN + DEQUANTIZED)})")
        self.config = self._config()
        native = any(t.tensor_type.name in NATIVE for t in self.reader.tensors)
        self.quantization = "gguf" if native and not dequantize else None  # weights the loader keeps quantized
        self.group_size = 32

    def describe(self) -> str:
        kinds = ", ".join(f"{n} {k}" for k, n in self.tensor_types().most_common())
        return f"{self.path} (GGUF {self.arch_name}: {kinds}{', dequantized' if self.dequantize else ''})"

    # ---- metadata --------------------------------------------------------------------------
    def _field(self, key: str, default=None):
        value = self.reader.fields.get(key)
        if value is None:
            return default
        return value.tolist() if isinstance(value, (np.ndarray, StringArray)) else value

    def _arch_field(self, key: str, default=None, required: bool = False):
        value = self._field(f"{self.arch_name}.{key}", default)
        if value is None and required:
            raise GGUFError(f"{self.path}: metadata lacks {self.arch_name}.{key}")
        if isinstance(value, list):
            raise GGUFError(f"{self.path}: {self.arch_name}.{key} varies per layer, which sieve does not support")
        return value

    def _context_length(self) -> int:
        """The file's context length, within what any model has (a hostile file's 2^40 sized the rotary tables before
        any cap and crashed the load)."""
        n = self._arch_field("context_length", 2048)
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 1 <= int(n) <= MAX_CONTEXT:
            raise GGUFError(f"{self.path}: {self.arch_name}.context_length {n!r} is not a context length (1 to {MAX_CONTEXT})")
        return int(n)

    def decode_bytes(self) -> int:
        """Weight bytes one decode step reads as stored: every matrix, the embedding only where it is the
        (tied) LM head (otherwise a step reads one row of it)."""
        tied = "output.weight" not in self._tensors
        return sum(int(t.n_bytes) for t in self.reader.tensors
                   if len(t.shape) == 2 and (t.name != "token_embd.weight" or tied))

    def tensor_types(self) -> Counter:
        return Counter(t.tensor_type.name for t in self.reader.tensors)

    def _config(self) -> dict:
        heads = int(self._arch_field("attention.head_count", required=True))
        hidden = int(self._arch_field("embedding_length", required=True))
        tokens = self.reader.fields.get("tokenizer.ggml.tokens")
        embd = self._tensors.get("token_embd.weight")
        if embd is None:
            raise GGUFError(f"{self.path}: no token_embd.weight tensor")
        vocab = self._arch_field("vocab_size") or (len(tokens) if tokens is not None else int(embd.shape[-1]))
        eos = [self._field(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        cfg = dict(
            architectures=[ARCHITECTURES[self.arch_name]], model_type=self.arch_name,
            hidden_size=hidden, intermediate_size=int(self._arch_field("feed_forward_length", required=True)),
            num_hidden_layers=int(self._arch_field("block_count", required=True)), num_attention_heads=heads,
            num_key_value_heads=int(self._arch_field("attention.head_count_kv", heads)),
            head_dim=int(self._arch_field("attention.key_length", hidden // heads)),
            rms_norm_eps=float(self._arch_field("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(self._arch_field("rope.freq_base", 10000.0)),
            max_position_embeddings=self._context_length(),
            vocab_size=int(vocab), tie_word_embeddings="output.weight" not in self._tensors,
            attention_bias="blk.0.attn_q.bias" in self._tensors and self.arch_name == "llama",
            eos_token_id=[int(e) for e in dict.fromkeys(eos) if e is not None],
            bos_token_id=self._field("tokenizer.ggml.bos_token_id"),
            torch_dtype=self._dtype(),
        )
        if self.arch_name == "qwen2":
            cfg["use_sliding_window"] = False
        if self.arch_name == "gemma3":
            cfg.update(self._gemma3_config(cfg))
        scaling = self._arch_field("rope.scaling.type")
        if scaling in ("linear",):
            cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(self._arch_field("rope.scaling.factor", 1.0))}
        elif scaling not in (None, "none"):
            raise GGUFError(f"{self.path}: rope scaling {scaling!r} is not supported (supported: none, linear, rope_freqs)")
        if "rope_freqs.weight" in self._tensors:  # llama.cpp's form of Llama 3.1 rope scaling: a divisor per frequency
            cfg["rope_scaling"] = {"rope_type": "freq_factors", "factors": self._array("rope_freqs.weight").tolist()}
        return cfg

    def _gemma3_config(self, cfg: dict) -> dict:
        """What llama.cpp fixes for Gemma 3 rather than storing: every sixth layer global, the others sliding with
        rotary base 10,000; softmax scale 1/sqrt(head_dim) (1/sqrt(hidden/heads) for the 62-layer 27B); GeGLU."""
        window = self._arch_field("attention.sliding_window")
        layers, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
        out = dict(hidden_activation="gelu_pytorch_tanh", rope_local_base_freq=10_000.0, sliding_window_pattern=6,
                   sliding_window=int(window) if window else None,
                   query_pre_attn_scalar=cfg["hidden_size"] // heads if layers == 62 else cfg["head_dim"],
                   final_logit_softcapping=self._arch_field("final_logit_softcapping"))
        if self._arch_field("attn_logit_softcapping") is not None:
            raise GGUFError(f"{self.path}: attention logit softcapping is not supported")
        tokens = self.reader.fields.get("tokenizer.ggml.tokens")
        if tokens is not None:
            for i in range(min(len(tokens), 1024)):
                if tokens[i] == GEMMA_END_OF_TURN:
                    out["eos_token_id"] = list(dict.fromkeys(cfg["eos_token_id"] + [i]))
                    break
        return out

    def _dtype(self) -> str:
        """The model dtype "auto" means for this file: that of its float weights if all are one float type
        (float16 runs as bfloat16 on CPU, see the loader); float32 activations where any weight is quantized,
        as llama.cpp computes: the native kernels read the weights as stored and round only their inputs
        to bf16. On SmolLM2-135M (Q4_1) that agrees with the float32 reference on 99.5% of next tokens
        (KL 1e-4) at the same batch-1 speed, against 97% with bf16 activations (KL 1e-3), where a chat
        answer could turn on how the prompt was chunked."""
        kinds = {t.tensor_type.name for t in self.reader.tensors if len(t.shape) == 2}
        if kinds == {"F16"}:
            return "float16"
        if kinds == {"BF16"}:
            return "bfloat16"
        return "float32"

    # ---- tensors ---------------------------------------------------------------------------
    def _array(self, name: str) -> np.ndarray:
        import gguf

        t = self._tensors[name]
        return gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(tuple(reversed([int(d) for d in t.shape])))

    def _hf_name(self, name: str) -> str | None:
        if name in _FROM_GGUF:
            return _FROM_GGUF[name]
        parts = name.split(".", 2)
        names = _GEMMA3_FROM_GGUF if self.arch_name == "gemma3" else _LAYER_FROM_GGUF
        if parts[0] == "blk" and len(parts) == 3 and parts[2] in names:
            return f"model.layers.{parts[1]}.{names[parts[2]]}"
        return None

    def _row_order(self, name: str, rows: int) -> np.ndarray | None:
        """llama.cpp permutes the rows of "llama" q / k for interleaved rotary; the order that undoes it."""
        if self.arch_name != "llama" or not name.endswith(("attn_q.weight", "attn_k.weight", "attn_q.bias", "attn_k.bias")):
            return None
        heads = self.config["num_attention_heads"] if ".attn_q." in name else self.config["num_key_value_heads"]
        return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(rows)

    def tensors(self):
        """(Hugging Face name, tensor or quantized weight) for every tensor the model uses."""
        widened: Counter = Counter()
        for t in self.reader.tensors:
            if t.name == "rope_freqs.weight":
                continue  # in the config
            hf = self._hf_name(t.name)
            if hf is None:
                raise GGUFError(f"{self.path}: tensor {t.name} has no place in a {self.arch_name} model")
            kind = t.tensor_type.name
            try:
                if kind in NATIVE and not self.dequantize:
                    value = self._quantized(t)
                else:
                    if kind not in PLAIN:
                        widened[kind] += 1
                    value = torch.from_numpy(np.array(self._array(t.name)))
            except GGUFError:
                raise
            except Exception as e:  # data past the end of a truncated file, bad block sizes
                raise GGUFError(f"{self.path}: tensor {t.name} ({kind}) is unreadable: {type(e).__name__}: {e}") from None
            order = self._row_order(t.name, int(t.shape[-1]) if len(t.shape) > 1 else int(t.shape[0]))
            if order is not None:
                value = _take_rows(value, torch.from_numpy(order))
            if self.arch_name == "gemma3" and hf.endswith("norm.weight"):
                value = value.float() - 1  # llama.cpp stores Gemma's norm scales as 1 + w; Hugging Face names mean w
            yield hf, value
        for kind, n in widened.items():
            why = "as asked (dequantize)" if self.dequantize else "(no native kernel for this type)"
            log.warning("GGUF: %d %s tensors dequantized to the model dtype %s", n, kind, why)

    def _quantized(self, t) -> ChannelScaledWeight | Int4Weight:
        kind = t.tensor_type.name
        rows, k = int(t.shape[-1]), int(t.shape[0])
        g = k // 32
        blocks = torch.from_numpy(np.array(t.data).reshape(rows, g, -1))
        if kind == "Q8_0":
            scale = blocks[..., :2].contiguous().view(torch.float16).view(rows, g)
            q = blocks[..., 2:].contiguous().view(torch.int8).view(rows, k)
            return ChannelScaledWeight(q, scale)
        d = blocks[..., :2].contiguous().view(torch.float16).view(rows, g)
        if kind == "Q4_0":
            m, qs = None, blocks[..., 2:]  # w = d (q - 8): no min stored
        else:
            m, qs = blocks[..., 2:4].contiguous().view(torch.float16).view(rows, g), blocks[..., 4:]
        values = torch.cat([qs & 0xF, qs >> 4], dim=-1).reshape(rows, k)  # block j: low nibbles 0-15, high 16-31
        return Int4Weight(pack_int4_pairs(values), d, m, 32, k)

    # ---- tokenizer -------------------------------------------------------------------------
    def tokenizer(self):
        """The file's tokenizer as a transformers fast tokenizer, with its chat template; converted once
        and cached under the sieve cache folder."""
        from transformers import AutoTokenizer

        from sieve.demo import cache_root

        st = self.path.stat()
        key = hashlib.sha256(f"{self.path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
        cached = cache_root() / "gguf-tokenizers" / key
        if (cached / "tokenizer.json").exists():
            return AutoTokenizer.from_pretrained(str(cached))
        if self._field("tokenizer.ggml.model") is None:
            raise GGUFError(f"{self.path} holds no tokenizer; pass --tokenizer PATH or --skip-tokenizer-init")
        log.info("converting the GGUF tokenizer of %s (once; cached in %s)", self.path.name, cached)
        try:
            tok = AutoTokenizer.from_pretrained(str(self.path.parent), gguf_file=self.path.name)
        except Exception as e:
            raise GGUFError(f"{self.path}: its tokenizer could not be converted: {type(e).__name__}: {e}") from None
        template = self._field("tokenizer.chat_template")
        if not template and self.arch_name == "gemma3":
            log.info("%s carries no chat template: using Gemma 3's", self.path.name)
            template = GEMMA3_CHAT_TEMPLATE
        if template:
            tok.chat_template = template
        tmp = cached.with_name(f"{key}.tmp{os.getpid()}")
        tok.save_pretrained(str(tmp))
        os.replace(tmp, cached) if not cached.exists() else None
        return tok


def _take_rows(value, order: torch.Tensor):
    if isinstance(value, torch.Tensor):
        return value[order].contiguous()
    if isinstance(value, ChannelScaledWeight):
        return value.like(value.q[order].contiguous(), value.scale[order].contiguous())
    return Int4Weight(value.packed[order].contiguous(), value.scale[order].contiguous(),
                      None if value.min is None else value.min[order].contiguous(), value.group, value.k)
