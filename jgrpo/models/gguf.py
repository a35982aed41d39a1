"""GGUF (llama.cpp) Llama checkpoints -> HF-style safetensors directories.

Tensors are dequantized to float32 with the `gguf` package. llama.cpp's converter permutes the
rows of every q/k projection into its interleaved rotary layout; we undo that so the result is the
HF (rotate-halves) layout the rest of jgrpo and transformers use. The tokenizer is built from the file's
metadata without torch (transformers' own GGUF path imports torch), so the quickstart's runtime install needs none.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute`: per head, rows (pairs interleaved) -> (first halves, second halves)."""
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's `permute` (HF -> GGUF layout); the inverse of `unpermute_rotary`."""
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, head_dim // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise KeyError(f"GGUF metadata lacks '{key}'")
        return default
    return field.contents()


def _float32_value(x) -> float:
    # GGUF stores e.g. rms eps as float32 (9.99999975e-06); keep the value the author wrote (1e-05).
    return float(str(np.float32(x)))


def gguf_hf_config(reader) -> dict:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture '{arch}' (only llama-family GGUF files are converted)")
    heads = int(_field(reader, "llama.attention.head_count"))
    hidden = int(_field(reader, "llama.embedding_length"))
    scaling = sorted(k for k in reader.fields if k.startswith("llama.rope.scaling"))
    if scaling:
        raise ValueError(f"unsupported GGUF rope scaling metadata {scaling}")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError("unsupported GGUF tensor 'rope_freqs.weight' (Llama 3 rope scaling stored as factors)")
    embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(_field(reader, "llama.vocab_size", int(embed.shape[-1]))),
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, "llama.attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, "llama.rope.dimension_count", hidden // heads)),
        "hidden_act": "silu",
        "rms_norm_eps": _float32_value(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": _float32_value(_field(reader, "llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, "llama.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": False,
        "torch_dtype": "float32",
    }
    for ours, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding")):
        if f"tokenizer.ggml.{key}_token_id" in reader.fields:
            config[f"{ours}_token_id"] = int(_field(reader, f"tokenizer.ggml.{key}_token_id"))
    return config


def gguf_tensors(reader, config: dict) -> dict[str, np.ndarray]:
    """All tensors, dequantized to float32, under HF names and in HF layout."""
    from gguf.quants import dequantize

    tensors = {}
    for t in reader.tensors:
        if t.name in _GLOBAL_NAMES:
            name = _GLOBAL_NAMES[t.name]
        else:
            match = re.fullmatch(r"blk\.(\d+)\.(.+)", t.name)
            if not match or match.group(2) not in _LAYER_NAMES:
                raise ValueError(f"unexpected GGUF tensor '{t.name}' for a llama model")
            name = f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if name.endswith("q_proj.weight"):
            w = unpermute_rotary(w, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = unpermute_rotary(w, config["num_key_value_heads"])
        tensors[name] = np.ascontiguousarray(w)
    return tensors


# llama.cpp's metadata keys -> the names transformers' GGUF tokenizer builders read (its GGUF_TOKENIZER_MAPPING).
_TOKENIZER_KEYS = {
    "model": "tokenizer_type", "pre": "pre_tokenizer_type", "tokens": "tokens", "scores": "scores",
    "token_type": "token_type", "merges": "merges", "precompiled_charsmap": "precompiled_charsmap",
    "bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "unknown_token_id": "unk_token_id",
    "padding_token_id": "pad_token_id", "add_space_prefix": "add_prefix_space",
}
_TOKENIZER_CONFIG_KEYS = {"chat_template": "chat_template", "ggml.add_bos_token": "add_bos_token",
                          "ggml.add_eos_token": "add_eos_token"}
_SPECIAL_TOKENS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                   "pad_token": "padding_token_id"}


def gguf_tokenizer(gguf_path: str | Path):
    """The GGUF file's tokenizer as a transformers fast tokenizer, read with the `gguf` package (no torch).

    The same tokenizer `AutoTokenizer.from_pretrained(dir, gguf_file=name)` builds (tokenizer.json byte for byte
    for SmolLM2), whose metadata reader imports torch. Transformers versions without the torch-free builder
    module fall back to that path."""
    import gguf

    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
    except ImportError:  # another transformers layout: its own (torch-needing) GGUF path
        from transformers import AutoTokenizer

        path = Path(gguf_path)
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    reader = gguf.GGUFReader(gguf_path)
    fields = {key: field.contents() for key, field in reader.fields.items() if key.startswith("tokenizer.")}
    tokenizer = {name: fields[f"tokenizer.ggml.{key}"] for key, name in _TOKENIZER_KEYS.items()
                 if f"tokenizer.ggml.{key}" in fields}
    config = {name: fields[f"tokenizer.{key}"] for key, name in _TOKENIZER_CONFIG_KEYS.items()
              if f"tokenizer.{key}" in fields}
    if tokenizer.get("tokenizer_type") == "llama":  # llama.cpp adds BOS to sentencepiece vocabularies by default
        config.setdefault("add_bos_token", True)
    for name, key in _SPECIAL_TOKENS.items():
        token_id = fields.get(f"tokenizer.ggml.{key}")
        config[name] = tokenizer["tokens"][token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(_field(reader, "general.architecture"), tokenizer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **config, **extra)


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write config.json, model.safetensors and the tokenizer (with chat template, if the file has one)."""
    import gguf
    from safetensors.numpy import save_file

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = gguf.GGUFReader(gguf_path)
    config = gguf_hf_config(reader)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(gguf_tensors(reader, config), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    if "tokenizer.ggml.model" in reader.fields:  # weights-only GGUF files carry no tokenizer
        gguf_tokenizer(gguf_path).save_pretrained(out_dir)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir
