"""LoRA adapters as a PEFT adapter directory (adapter_config.json + adapter_model.safetensors).

`peft.PeftModel.from_pretrained(base_model, OUT_DIR)` puts them on the Hugging Face base model. PEFT's
layer is y = x W^T + (alpha / r) (x lora_A^T) lora_B^T with lora_A [r, in] and lora_B [out, in] flattened
the way the HF weight is; ours is y = x W + (alpha / r) (x A) B with A [*in, r] and B [r, *out] per layer, in
the same flattening order as `hf_format.tensor_layouts` (q [D, H, Dh] <-> q_proj [H*Dh, D]; o [H, Dh, D] <->
o_proj [D, H*Dh]). So lora_A = A.reshape(in, r).T and lora_B = B.reshape(r, out).T: no permutation, exact.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np

from jgrpo.models.hf_format import tensor_layouts
from jgrpo.models.layer_stack import stacked_layers
from jgrpo.models.llm import LLMConfig
from jgrpo.models.lora import without_lora


def peft_tensors(adapters: dict, cfg: LLMConfig) -> dict[str, np.ndarray]:
    """PEFT's tensor names and values for our adapters of `cfg` (every layer of every target)."""
    layouts = tensor_layouts(without_lora(cfg))
    tensors = {}
    for target in cfg.lora_targets:
        a = np.asarray(jax.device_get(adapters["layers"][f"{target}_lora_a"]), np.float32)  # [L, *in, r]
        b = np.asarray(jax.device_get(adapters["layers"][f"{target}_lora_b"]), np.float32)  # [L, r, *out]
        module = layouts[("layers", target)].name.removesuffix(".weight")
        for at, i in enumerate(stacked_layers(cfg, target)):  # a periodic MoE stack: the dense layers' MLPs
            prefix = "base_model.model." + module.format(i=i)
            tensors[prefix + ".lora_A.weight"] = np.ascontiguousarray(a[at].reshape(-1, cfg.lora_rank).T)
            tensors[prefix + ".lora_B.weight"] = np.ascontiguousarray(b[at].reshape(cfg.lora_rank, -1).T)
    return tensors


def export_peft(adapters: dict, cfg: LLMConfig, out_dir: str | Path, base_model: str) -> Path:
    """Write `adapters` of `cfg` as a PEFT LoRA directory for the base model `base_model`."""
    from safetensors.numpy import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(peft_tensors(adapters, cfg), str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    layouts = tensor_layouts(without_lora(cfg))
    modules = sorted({layouts[("layers", t)].name.split(".")[-2] for t in cfg.lora_targets})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": cfg.lora_rank,
        "lora_alpha": cfg.lora_alpha,
        "lora_dropout": 0.0,
        "target_modules": modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
    }
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out_dir
