"""GGUF (llama.cpp) Llama checkpoints -> HF-style safetensors directories.

Tensors are dequantized to float32 with the `gguf` package. llama.cpp's converter permutes the
rows of every q/k projection into its interleaved rotary layout; we undo that so the result is the
HF (rotate-halves) layout the rest of jgrpo and transformers use.
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


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write config.json, model.safetensors and the tokenizer (with chat template, if the file has one)."""
    import gguf
    from safetensors.numpy import save_file
    from transformers import AutoTokenizer

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = gguf.GGUFReader(gguf_path)
    config = gguf_hf_config(reader)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(gguf_tensors(reader, config), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    if "tokenizer.ggml.model" in reader.fields:  # weights-only GGUF files carry no tokenizer
        AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name).save_pretrained(out_dir)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir
