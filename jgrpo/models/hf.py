"""Hugging Face checkpoints <-> jgrpo params: config.json mapping, safetensors loading and export.

Loading reads one tensor (one layer's slice of a stacked parameter) at a time from memory-mapped
safetensors and puts it straight onto its target sharding; layers are then stacked on the devices.
The host never holds more than one layer's tensor, so a large model loads onto a mesh without a
full host copy. With several processes (multi-host) each host reads every tensor once and sends each
of its own devices just that device's slice; nothing crosses between hosts.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from jgrpo.mesh import TRAIN_RULES, Rules, logical_to_spec
from jgrpo.models.builtin import resolve_model_dir
from jgrpo.models.llm import (
    _LOGICAL_AXES,
    SUPPORTED_ARCHITECTURES,
    SUPPORTED_ROPE_TYPES,
    LLMConfig,
    _param_shapes,
    abstract_model,
    position_ids_from_mask,
)

__all__ = [
    "llm_config_from_hf",
    "hf_config_from_llm",
    "load_params",
    "load_model",
    "load_tokenizer",
    "export_hf",
    "resolve_model_dir",  # re-exported: the contract names them here too
    "position_ids_from_mask",
]

_HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_FLOAT_DTYPES = (np.float16, np.float32, np.float64, ml_dtypes.bfloat16)
# Checkpoint entries that carry no weights of ours (recomputed buffers, tied copies) and are skipped.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def llm_config_from_hf(
    hf: dict[str, Any], *, param_dtype: str = "float32", compute_dtype: str = "float32", remat: str = "none",
    attention: str = "custom",
) -> LLMConfig:
    """LLMConfig from a config.json dict, honouring every field that changes the computation."""
    arch = hf.get("model_type")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture model_type='{arch}' (architectures={hf.get('architectures')}); "
            f"supported: {SUPPORTED_ARCHITECTURES}"
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act '{hf['hidden_act']}' (only silu / SwiGLU)")
    if hf.get("mlp_bias"):
        raise ValueError("unsupported mlp_bias=True")
    if hf.get("use_sliding_window"):
        raise ValueError("unsupported use_sliding_window=True (sliding-window attention)")
    layer_types = set(hf.get("layer_types") or ["full_attention"])
    if layer_types != {"full_attention"}:
        raise ValueError(f"unsupported layer_types {sorted(layer_types)} (only full_attention)")

    # transformers 5 writes `rope_parameters` (theta inside); older files `rope_theta` + `rope_scaling`.
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = rope.pop("rope_type", rope.pop("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type '{rope_type}'; supported: {SUPPORTED_ROPE_TYPES}")
    if float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))) != 1.0:
        raise ValueError("unsupported partial_rotary_factor != 1")
    rope.pop("partial_rotary_factor", None)
    rope_scaling = None if rope_type == "default" else tuple(sorted({**rope, "rope_type": rope_type}.items()))

    heads = hf["num_attention_heads"]
    attention_bias = bool(hf.get("attention_bias", False))
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
        qk_norm=arch == "qwen3",
        max_position_embeddings=hf.get("max_position_embeddings"),
        param_dtype=param_dtype,
        compute_dtype=compute_dtype,
        remat=remat,
        attention=attention,
        architecture=arch,
    )


def hf_config_from_llm(cfg: LLMConfig, **token_ids) -> dict[str, Any]:
    """config.json dict for transformers; `token_ids` (bos/eos/pad_token_id) are copied in."""
    if cfg.architecture == "qwen2" and (not cfg.qkv_bias or cfg.o_bias):
        raise ValueError("qwen2 checkpoints have q/k/v biases and no o bias; this config cannot be exported as qwen2")
    if cfg.architecture in ("llama", "qwen3") and cfg.qkv_bias != cfg.o_bias:
        raise ValueError(f"{cfg.architecture} attention_bias covers q/k/v and o together; got qkv={cfg.qkv_bias}")
    if cfg.qk_norm != (cfg.architecture == "qwen3"):
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
    hf.update({k: v for k, v in token_ids.items() if v is not None})
    return hf


@dataclasses.dataclass(frozen=True)
class _Layout:
    """How one of our parameters is stored in an HF checkpoint (per layer for stacked ones)."""

    name: str  # HF tensor name; "{i}" is the layer index
    hf_shape: tuple[int, ...]
    to_ours: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]


def _layouts(cfg: LLMConfig) -> dict[tuple[str, ...], _Layout]:
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
    }
    return {
        path: _Layout(name, shape, *fns) for path, (name, shape, fns) in table.items() if path in _param_shapes(cfg)
    }


class _Checkpoint:
    """Memory-mapped view of model.safetensors or a sharded model.safetensors.index.json."""

    def __init__(self, model_dir: Path):
        from safetensors import safe_open

        index = model_dir / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (model_dir / "model.safetensors").exists():
            with safe_open(model_dir / "model.safetensors", framework="np") as f:
                weight_map = {name: "model.safetensors" for name in f.keys()}  # noqa: SIM118
        else:
            raise FileNotFoundError(f"{model_dir} has neither model.safetensors nor model.safetensors.index.json")
        self._files = {file: safe_open(model_dir / file, framework="np") for file in set(weight_map.values())}
        self._weight_map = weight_map

    def names(self) -> set[str]:
        return set(self._weight_map)

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self._weight_map:
            raise KeyError(f"checkpoint is missing tensor '{name}'")
        handle = self._files[self._weight_map[name]]
        piece = handle.get_slice(name)
        got = tuple(piece.get_shape())
        if got != shape:
            raise ValueError(f"tensor '{name}' has shape {got}, expected {shape}")
        tensor = handle.get_tensor(name)
        if tensor.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"tensor '{name}' has dtype {tensor.dtype}; expected a floating point dtype")
        return tensor


def _sharding(path, shape, mesh, rules) -> jax.sharding.Sharding:
    if mesh is None:
        return SingleDeviceSharding(jax.devices()[0])
    return NamedSharding(mesh, logical_to_spec(PartitionSpec(*_LOGICAL_AXES[path]), rules, shape, mesh))


def load_params(model_dir: str | Path, cfg: LLMConfig, *, mesh=None, rules: Rules | None = None) -> dict:
    """Params pytree for `cfg` from an HF safetensors directory, each leaf on its target sharding.

    With a mesh, `rules` (default jgrpo.mesh.TRAIN_RULES) maps each parameter's logical axes to it.
    """
    rules = TRAIN_RULES if rules is None else rules
    ckpt = _Checkpoint(Path(model_dir))
    layouts = _layouts(cfg)
    expected = {
        lay.name.format(i=i)
        for path, lay in layouts.items()
        for i in range(cfg.num_layers if path[0] == "layers" else 1)
    }
    skippable = {"lm_head.weight"} if cfg.tie_word_embeddings else set()  # some tied checkpoints store the copy
    unexpected = sorted(n for n in ckpt.names() - expected - skippable if not n.endswith(_IGNORED_SUFFIXES))
    if unexpected:
        raise ValueError(f"checkpoint has unexpected tensors for a {cfg.architecture} config: {unexpected[:8]}")
    missing = sorted(expected - ckpt.names())
    if missing:
        raise KeyError(f"checkpoint is missing tensors: {missing[:8]}")

    dtype = np.dtype(jnp.dtype(cfg.param_dtype))
    shapes = _param_shapes(cfg)
    params: dict = {"layers": {}}
    for path, layout in layouts.items():
        sharding = _sharding(path, shapes[path], mesh, rules)

        def host(name, layout=layout):  # one tensor on the host, in our layout and dtype
            return np.ascontiguousarray(layout.to_ours(ckpt.get(name, layout.hf_shape)).astype(dtype))

        if path[0] != "layers":
            params[path[0]] = _place(host(layout.name), sharding)
            continue
        # Each layer goes onto the devices with the layer axis dropped, then layers are stacked there.
        per_layer = _drop_layer_axis(sharding)
        layers = [_place(host(layout.name.format(i=i)), per_layer) for i in range(cfg.num_layers)]
        params["layers"][path[1]] = jax.jit(lambda *xs: jnp.stack(xs), out_shardings=sharding)(*layers)
        del layers
    return params


def _place(value: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """A host array onto `sharding`, each local device receiving only its own slice.

    Not device_put: with several processes the sharding spans other hosts' devices, and device_put would
    first all-gather the whole tensor across hosts to check that every one passed the same value.
    """
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def _drop_layer_axis(sharding):
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec(*tuple(sharding.spec)[1:]))
    return sharding


def load_model(
    name_or_path: str,
    *,
    param_dtype: str = "float32",
    compute_dtype: str = "float32",
    remat: str = "none",
    attention: str = "custom",
    mesh=None,
    rules: Rules | None = None,
):
    """(graphdef, params, LLMConfig) for a built-in name, HF directory, .gguf file or hub id."""
    model_dir = resolve_model_dir(name_or_path)
    config_file = model_dir / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"{model_dir} has no config.json")
    cfg = llm_config_from_hf(
        json.loads(config_file.read_text()), param_dtype=param_dtype, compute_dtype=compute_dtype, remat=remat,
        attention=attention,
    )
    graphdef, _ = abstract_model(cfg)
    return graphdef, load_params(model_dir, cfg, mesh=mesh, rules=rules), cfg


def load_tokenizer(name_or_path: str):
    """The transformers tokenizer (with its chat template) stored beside the weights."""
    from transformers import AutoTokenizer

    model_dir = resolve_model_dir(name_or_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except Exception as e:  # noqa: BLE001 - re-raised with the directory named
        raise FileNotFoundError(f"no usable tokenizer in {model_dir}: {e}") from e
    return tokenizer


def export_hf(params: dict, cfg: LLMConfig, tokenizer, out_dir: str | Path) -> Path:
    """Write params as an HF checkpoint (model.safetensors, config.json, tokenizer files) to `out_dir`."""
    from safetensors.numpy import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, np.ndarray] = {}
    for path, layout in _layouts(cfg).items():
        node = params
        for key in path:
            if key not in node:
                raise KeyError(f"params lack '{'/'.join(path)}' required by the config")
            node = node[key]
        value = np.asarray(jax.device_get(node))
        if value.shape != _param_shapes(cfg)[path]:
            raise ValueError(f"param '{'/'.join(path)}' has shape {value.shape}, expected {_param_shapes(cfg)[path]}")
        if path[0] == "layers":
            for i in range(cfg.num_layers):
                tensors[layout.name.format(i=i)] = np.ascontiguousarray(layout.to_hf(value[i]))
        else:
            tensors[layout.name] = np.ascontiguousarray(layout.to_hf(value))
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    token_ids = {}
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
        token_ids = {f"{k}_token_id": getattr(tokenizer, f"{k}_token_id", None) for k in ("bos", "eos", "pad")}
    (out_dir / "config.json").write_text(json.dumps(hf_config_from_llm(cfg, **token_ids), indent=2))
    return out_dir
