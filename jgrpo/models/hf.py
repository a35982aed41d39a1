"""Loading Hugging Face checkpoints into jgrpo params (the format itself: `jgrpo.models.hf_format`).

Loading reads one tensor (one layer's slice of a stacked parameter) at a time from memory-mapped
safetensors and puts it straight onto its target sharding; layers are then stacked on the devices.
The host never holds more than one layer's tensor, so a large model loads onto a mesh without a
full host copy. With several processes (multi-host) each host reads every tensor once and sends each
of its own devices just that device's slice; nothing crosses between hosts.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from jgrpo.models.attention_backends import resolve_attention
from jgrpo.models.builtin import ModelNotFound, resolve_model_dir
from jgrpo.models.expert_parallel import resolve_moe_dispatch
from jgrpo.models.hf_format import expert_names, export_hf, hf_config_from_llm, llm_config_from_hf, tensor_layouts
from jgrpo.models.layer_stack import stacked_layers
from jgrpo.models.llm import LLMConfig, ModelOptions, abstract_model, position_ids_from_mask
from jgrpo.models.lora import is_adapter, join_adapters, with_lora
from jgrpo.models.moe import resolve_moe_impl
from jgrpo.models.param_spec import ParamSpec
from jgrpo.models.parameters import param_specs, weight_specs
from jgrpo.parallel.mesh import TRAIN_RULES, Rules, logical_to_spec

# One import for users: loading here, the format's converters re-exported from hf_format.
__all__ = [
    "llm_config_from_hf",
    "hf_config_from_llm",
    "load_params",
    "load_model",
    "model_options",
    "load_tokenizer",
    "export_hf",
    "resolve_model_dir",
    "position_ids_from_mask",
]

_FLOAT_DTYPES = (np.float16, np.float32, np.float64, ml_dtypes.bfloat16)
# Checkpoint entries that carry no weights of ours (recomputed buffers, tied copies) and are skipped.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


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
            raise ModelNotFound(f"{model_dir} has neither model.safetensors nor model.safetensors.index.json")
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


def _sharding(spec: ParamSpec, mesh, rules) -> jax.sharding.Sharding:
    if mesh is None:
        return SingleDeviceSharding(jax.devices()[0])
    return NamedSharding(mesh, logical_to_spec(PartitionSpec(*spec.axes), rules, spec.shape, mesh))


def load_params(model_dir: str | Path, cfg: LLMConfig, *, mesh=None, rules: Rules | None = None) -> dict:
    """Params pytree for `cfg` from an HF safetensors directory, each leaf on its target sharding.

    With a mesh, `rules` (default jgrpo.parallel.mesh.TRAIN_RULES) maps each parameter's logical axes to it.
    """
    rules = TRAIN_RULES if rules is None else rules
    ckpt = _Checkpoint(Path(model_dir))
    layouts = tensor_layouts(cfg)
    expected = {name for path, lay in layouts.items() if path[0] == "layers"
                for i in stacked_layers(cfg, path[1]) for name in expert_names(lay, cfg, i)}
    expected |= {lay.name for path, lay in layouts.items() if path[0] != "layers"}
    skippable = {"lm_head.weight"} if cfg.tie_word_embeddings else set()  # some tied checkpoints store the copy
    unexpected = sorted(n for n in ckpt.names() - expected - skippable if not n.endswith(_IGNORED_SUFFIXES))
    if unexpected:
        raise ValueError(f"checkpoint has unexpected tensors for a {cfg.architecture} config: {unexpected[:8]}")
    missing = sorted(expected - ckpt.names())
    if missing:
        raise KeyError(f"checkpoint is missing tensors: {missing[:8]}")

    specs = weight_specs(cfg)
    params: dict = {"layers": {}}
    for path, layout in layouts.items():
        sharding = _sharding(specs[path], mesh, rules)
        dtype = np.dtype(jnp.dtype(specs[path].dtype))

        def host(names, layout=layout, dtype=dtype):  # one tensor (a layer's experts stacked), ours on the host
            value = [layout.to_ours(ckpt.get(name, layout.hf_shape)).astype(dtype) for name in names]
            return np.ascontiguousarray(np.stack(value) if layout.per_expert else value[0])

        if path[0] != "layers":
            params[path[0]] = _place(host([layout.name]), sharding)
            continue
        # Each layer goes onto the devices with the layer axis dropped, then layers are stacked there.
        per_layer = _drop_layer_axis(sharding)
        layers = [_place(host(expert_names(layout, cfg, i)), per_layer) for i in stacked_layers(cfg, path[1])]
        params["layers"][path[1]] = jax.jit(lambda *xs: jnp.stack(xs), out_shardings=sharding)(*layers)
        del layers
    return params


def _place(value: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """A host array onto `sharding`, each local device receiving only its own slice.

    Not device_put: with several processes the sharding spans other hosts' devices, and device_put would
    first all-gather the whole tensor across hosts to check that every one passed the same value.
    """
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index], dtype=value.dtype)


def _drop_layer_axis(sharding):
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec(*tuple(sharding.spec)[1:]))
    return sharding


def load_model(name_or_path: str, options: ModelOptions = ModelOptions(), *, mesh=None, rules: Rules | None = None,
               lora: tuple[int, float, tuple[str, ...]] = (0, 16.0, ()), seed: int = 0):
    """(graphdef, params, LLMConfig) for a built-in name, HF directory, .gguf file or hub id, with a run's `options`
    (dtypes, remat, implementations: `model_options`).

    `lora` = (rank, alpha, targets): fresh adapters (`new_adapters`, from `seed`) beside the loaded weights.
    """
    model_dir = resolve_model_dir(name_or_path)
    config_file = model_dir / "config.json"
    if not config_file.exists():
        raise ModelNotFound(f"{model_dir} has no config.json: not a Hugging Face model directory")
    cfg = with_lora(llm_config_from_hf(json.loads(config_file.read_text()), options), *lora)
    graphdef, _ = abstract_model(cfg)
    params = load_params(model_dir, cfg, mesh=mesh, rules=rules)
    if cfg.lora_rank:
        params = join_adapters(new_adapters(cfg, seed, mesh=mesh, rules=rules), params)
    return graphdef, params, cfg


def model_options(model, platform: str) -> ModelOptions:
    """`load_model`'s (and `model_shapes`') options from a run's `model` config section, with the per-platform
    choices (`attention`, `moe_impl`: auto) resolved for `platform`."""
    return ModelOptions(param_dtype=model.param_dtype, compute_dtype=model.compute_dtype, remat=model.remat,
                        attention=resolve_attention(model.attention, platform),
                        moe_impl=resolve_moe_impl(model.moe_impl, platform),
                        moe_dispatch=resolve_moe_dispatch(model.moe_dispatch, platform))


def new_adapters(cfg: LLMConfig, seed: int, *, mesh=None, rules: Rules | None = None) -> dict:
    """Freshly initialised LoRA adapters of `cfg` (B = 0: the model is unchanged), each on its sharding."""
    rules = TRAIN_RULES if rules is None else rules
    specs = {path: spec for path, spec in param_specs(cfg).items() if is_adapter(path[-1])}
    keys = jax.random.split(jax.random.key(seed), len(specs))
    layers = {}
    for key, (path, spec) in zip(keys, specs.items(), strict=True):
        init = functools.partial(_initial_value, spec)
        layers[path[1]] = jax.jit(init, out_shardings=_sharding(spec, mesh, rules))(key)
    return {"layers": layers}


def _initial_value(spec: ParamSpec, key: jax.Array) -> jax.Array:
    return spec.initial_value(lambda: key)


def load_tokenizer(name_or_path: str):
    """The transformers tokenizer (with its chat template) stored beside the weights."""
    from transformers import AutoTokenizer

    model_dir = resolve_model_dir(name_or_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except Exception as e:  # noqa: BLE001 - re-raised with the directory named
        raise ModelNotFound(f"no usable tokenizer in {model_dir}: {e}") from e
    return tokenizer
