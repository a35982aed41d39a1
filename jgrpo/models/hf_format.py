"""The Hugging Face checkpoint format: config.json <-> LLMConfig, where each of our parameters lives in a
safetensors file (name, shape, transpose), and export of params as an HF directory.

`jgrpo.models.hf` loads checkpoints with this table; `jgrpo.models.builtin` writes built-in models with
`export_hf`. Neither is imported here, so the format has no dependency on where models come from.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jgrpo.config.errors import ConfigError
from jgrpo.models.architecture import SUPPORTED_ARCHITECTURES, SUPPORTED_ROPE_TYPES, LLMConfig, ModelOptions
from jgrpo.models.layer_stack import stacked_layers
from jgrpo.models.parameters import weight_specs

__all__ = ["TensorLayout", "expert_names", "export_hf", "hf_config_from_llm", "llm_config_from_hf", "tensor_layouts"]

_HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
               "qwen3_moe": "Qwen3MoeForCausalLM"}


def llm_config_from_hf(hf: dict[str, Any], options: ModelOptions = ModelOptions()) -> LLMConfig:
    """LLMConfig from a config.json dict, honouring every field that changes the computation, with a run's
    `options` (dtypes, remat, implementations)."""
    arch = hf.get("model_type")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(
            f"model.name: unsupported architecture model_type='{arch}' (architectures={hf.get('architectures')}); "
            f"supported: {SUPPORTED_ARCHITECTURES}"
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"model.name: unsupported hidden_act '{hf['hidden_act']}' (only silu / SwiGLU)")
    if hf.get("mlp_bias"):
        raise ConfigError("model.name: unsupported mlp_bias=True")
    if hf.get("use_sliding_window"):
        raise ConfigError("model.name: unsupported use_sliding_window=True (sliding-window attention)")
    layer_types = set(hf.get("layer_types") or ["full_attention"])
    if layer_types != {"full_attention"}:
        raise ConfigError(f"model.name: unsupported layer_types {sorted(layer_types)} (only full_attention)")

    # transformers 5 writes `rope_parameters` (theta inside); older files `rope_theta` + `rope_scaling`.
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = rope.pop("rope_type", rope.pop("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(f"model.name: unsupported rope type '{rope_type}'; supported: {SUPPORTED_ROPE_TYPES}")
    if float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))) != 1.0:
        raise ConfigError("model.name: unsupported partial_rotary_factor != 1")
    rope.pop("partial_rotary_factor", None)
    rope_scaling = None if rope_type == "default" else tuple(sorted({**rope, "rope_type": rope_type}.items()))

    heads = hf["num_attention_heads"]
    attention_bias = bool(hf.get("attention_bias", False))
    moe = _moe_fields(hf) if arch == "qwen3_moe" else {}
    return LLMConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rope_theta=theta,
        rope_scaling=rope_scaling,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=True if arch == "qwen2" else attention_bias,  # Qwen2 always has q/k/v biases, never o
        o_bias=False if arch == "qwen2" else attention_bias,
        qk_norm=arch in ("qwen3", "qwen3_moe"),
        max_position_embeddings=hf.get("max_position_embeddings"),
        architecture=arch,
        **options._asdict(),
        **moe,
    )


def _moe_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """LLMConfig's mixture-of-experts fields from a qwen3_moe config.json (transformers 5 writes
    `num_local_experts`, the Qwen checkpoints `num_experts`; `norm_topk_prob` absent = false, as transformers'
    config class). Layer i is sparse when it is not in `mlp_only_layers` and (i + 1) % decoder_sparse_step == 0
    (transformers); the layers scan in periods (models/layer_stack.py), so the sparse layers must be every s-th."""
    layers, step = hf["num_hidden_layers"], int(hf.get("decoder_sparse_step", 1))
    dense = sorted(int(i) for i in hf.get("mlp_only_layers") or [])
    sparse = [i for i in range(layers) if i not in dense and (i + 1) % step == 0]
    period = next((s for s in range(1, layers + 1)
                   if layers % s == 0 and sparse == [i for i in range(layers) if (i + 1) % s == 0]), None)
    if period is None:
        raise ConfigError(f"model.name: qwen3_moe with decoder_sparse_step={step} and mlp_only_layers={dense} makes "
                          f"layers {sparse} of {layers} mixtures of experts; supported: every s-th layer, s dividing "
                          f"the {layers} layers (layers s-1, 2s-1, ...: decoder_sparse_step s with mlp_only_layers "
                          "empty or naming only dense layers)")
    return {"num_experts": int(hf.get("num_experts") or hf["num_local_experts"]),
            "experts_per_token": int(hf["num_experts_per_tok"]),
            "moe_intermediate_size": int(hf["moe_intermediate_size"]),
            "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
            "decoder_sparse_step": period}


def hf_config_from_llm(cfg: LLMConfig, **token_ids) -> dict[str, Any]:
    """config.json dict for transformers; `token_ids` (bos/eos/pad_token_id) are copied in."""
    if cfg.architecture == "qwen2" and (not cfg.qkv_bias or cfg.o_bias):
        raise ValueError("qwen2 checkpoints have q/k/v biases and no o bias; this config cannot be exported as qwen2")
    if cfg.architecture in ("llama", "qwen3") and cfg.qkv_bias != cfg.o_bias:
        raise ValueError(f"{cfg.architecture} attention_bias covers q/k/v and o together; got qkv={cfg.qkv_bias}")
    if cfg.qk_norm != (cfg.architecture in ("qwen3", "qwen3_moe")):
        raise ValueError(f"qk_norm={cfg.qk_norm} does not match architecture {cfg.architecture}")
    hf = {
        "architectures": [_HF_CLASSES[cfg.architecture]],
        "model_type": cfg.architecture,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_params or None,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "torch_dtype": cfg.param_dtype,
    }
    if cfg.max_position_embeddings:
        hf["max_position_embeddings"] = cfg.max_position_embeddings
    if cfg.architecture != "qwen2":
        hf["attention_bias"] = cfg.qkv_bias
    if cfg.num_experts:
        hf |= {"num_experts": cfg.num_experts, "num_experts_per_tok": cfg.experts_per_token,
               "moe_intermediate_size": cfg.moe_intermediate_size, "norm_topk_prob": cfg.norm_topk_prob,
               "decoder_sparse_step": cfg.decoder_sparse_step, "mlp_only_layers": []}
    hf.update({k: v for k, v in token_ids.items() if v is not None})
    return hf


@dataclasses.dataclass(frozen=True)
class TensorLayout:
    """How one of our parameters is stored in an HF checkpoint (per layer for stacked ones)."""

    name: str  # HF tensor name; "{i}" is the layer index, "{e}" the expert's (one tensor per expert, stacked)
    hf_shape: tuple[int, ...]
    to_ours: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]

    @property
    def per_expert(self) -> bool:
        """One tensor per expert (`name` has "{e}"), stacked along our [E] axis."""
        return "{e}" in self.name


def tensor_layouts(cfg: LLMConfig) -> dict[tuple[str, ...], TensorLayout]:
    D, F, V, H, KVH, Dh = (
        cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    )  # fmt: skip
    same = (lambda w: w, lambda w: w)
    transpose = (lambda w: w.T, lambda w: w.T)

    def proj_in(n):  # torch Linear [n*Dh, D] <-> ours [D, n, Dh]
        return (lambda w: w.T.reshape(D, n, Dh), lambda w: w.reshape(D, n * Dh).T)

    def bias(n):  # [n*Dh] <-> [n, Dh]
        return (lambda b: b.reshape(n, Dh), lambda b: b.reshape(n * Dh))

    pre, attn, mlp = "model.layers.{i}.", "model.layers.{i}.self_attn.", "model.layers.{i}.mlp."
    table = {
        ("embed",): ("model.embed_tokens.weight", (V, D), same),
        ("final_norm",): ("model.norm.weight", (D,), same),
        ("lm_head",): ("lm_head.weight", (V, D), transpose),
        ("layers", "attn_norm"): (pre + "input_layernorm.weight", (D,), same),
        ("layers", "mlp_norm"): (pre + "post_attention_layernorm.weight", (D,), same),
        ("layers", "q"): (attn + "q_proj.weight", (H * Dh, D), proj_in(H)),
        ("layers", "k"): (attn + "k_proj.weight", (KVH * Dh, D), proj_in(KVH)),
        ("layers", "v"): (attn + "v_proj.weight", (KVH * Dh, D), proj_in(KVH)),
        ("layers", "q_bias"): (attn + "q_proj.bias", (H * Dh,), bias(H)),
        ("layers", "k_bias"): (attn + "k_proj.bias", (KVH * Dh,), bias(KVH)),
        ("layers", "v_bias"): (attn + "v_proj.bias", (KVH * Dh,), bias(KVH)),
        ("layers", "q_norm"): (attn + "q_norm.weight", (Dh,), same),
        ("layers", "k_norm"): (attn + "k_norm.weight", (Dh,), same),
        # torch [D, H*Dh] <-> ours [H, Dh, D]
        ("layers", "o"): (
            attn + "o_proj.weight",
            (D, H * Dh),
            (lambda w: w.T.reshape(H, Dh, D), lambda w: w.reshape(H * Dh, D).T),
        ),
        ("layers", "o_bias"): (attn + "o_proj.bias", (D,), same),
        ("layers", "gate"): (mlp + "gate_proj.weight", (F, D), transpose),
        ("layers", "up"): (mlp + "up_proj.weight", (F, D), transpose),
        ("layers", "down"): (mlp + "down_proj.weight", (D, F), transpose),
        ("layers", "router"): (mlp + "gate.weight", (cfg.num_experts, D), transpose),
        ("layers", "experts_gate"): (mlp + "experts.{e}.gate_proj.weight", (cfg.moe_intermediate_size, D), transpose),
        ("layers", "experts_up"): (mlp + "experts.{e}.up_proj.weight", (cfg.moe_intermediate_size, D), transpose),
        ("layers", "experts_down"): (mlp + "experts.{e}.down_proj.weight", (D, cfg.moe_intermediate_size),
                                     transpose),
    }
    ours = weight_specs(cfg)
    return {path: TensorLayout(name, shape, *fns) for path, (name, shape, fns) in table.items() if path in ours}


def expert_names(layout: TensorLayout, cfg: LLMConfig, layer: int) -> list[str]:
    """The HF tensors of one layer's slice of a stacked parameter: one name, or one per expert."""
    if layout.per_expert:
        return [layout.name.format(i=layer, e=e) for e in range(cfg.num_experts)]
    return [layout.name.format(i=layer)]


def export_hf(params: dict, cfg: LLMConfig, tokenizer, out_dir: str | Path) -> Path:
    """Write params as an HF checkpoint (model.safetensors, config.json, tokenizer files) to `out_dir`."""
    from safetensors.numpy import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, np.ndarray] = {}
    specs = weight_specs(cfg)
    for path, layout in tensor_layouts(cfg).items():
        node = params
        for key in path:
            if key not in node:
                raise KeyError(f"params lack '{'/'.join(path)}' required by the config")
            node = node[key]
        value = np.asarray(jax.device_get(node))
        expected = specs[path].shape
        if value.shape != expected:
            raise ValueError(f"param '{'/'.join(path)}' has shape {value.shape}, expected {expected}")
        if path[0] == "layers":
            for at, i in enumerate(stacked_layers(cfg, path[1])):
                for e, name in enumerate(expert_names(layout, cfg, i)):
                    one = value[at, e] if layout.per_expert else value[at]
                    tensors[name] = np.ascontiguousarray(layout.to_hf(one))
        else:
            tensors[layout.name] = np.ascontiguousarray(layout.to_hf(value))
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    token_ids = {}
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
        token_ids = {f"{k}_token_id": getattr(tokenizer, f"{k}_token_id", None) for k in ("bos", "eos", "pad")}
    (out_dir / "config.json").write_text(json.dumps(hf_config_from_llm(cfg, **token_ids), indent=2))
    return out_dir
