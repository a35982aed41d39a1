"""The decoder's config, `LLMConfig`, the choices it is checked against, and a run's options for it that a checkpoint
does not hold (`ModelOptions`); its parameters are declared in `parameters.py`. `jgrpo.models.llm` re-exports these
names."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from jgrpo.models.attention_backends import IMPLEMENTATIONS as ATTENTION_IMPLEMENTATIONS
from jgrpo.models.lora import check_lora
from jgrpo.models.moe import IMPLEMENTATIONS as MOE_IMPLEMENTATIONS
from jgrpo.models.quantize import check_int8

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3_moe")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
REMAT_POLICIES = ("none", "full", "dots")
DTYPES = ("float32", "bfloat16", "float16")


class ModelOptions(NamedTuple):
    """A run's choices for a model that its checkpoint's config.json does not hold (`LLMConfig`'s other fields come
    from there): the dtypes, remat, and the per-platform implementations (`hf.model_options` resolves `auto`)."""

    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    remat: str = "none"
    attention: str = "custom"
    moe_impl: str = "sorted_tiles"
    moe_dispatch: str = "all_gather"


@dataclasses.dataclass(frozen=True, kw_only=True)
class LLMConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    # Sorted (key, value) items of the HF rope parameters besides the theta (hashable), or None = plain RoPE.
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    rms_norm_eps: float = 1e-6
    # Kept for export only: none of the supported rope types depends on it.
    max_position_embeddings: int | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    remat: str = "none"
    # The attention implementation (jgrpo.models.attention_backends; `model.attention` resolved for the platform).
    attention: str = "custom"
    # HF model_type this config came from (decides config.json and tensor names on export).
    architecture: str = "llama"
    # LoRA adapters (models/lora.py) on these projections; rank 0 = none. Not part of the HF config.
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = ()
    # Mixture of experts (models/moe.py; Qwen3-MoE): every layer's MLP is `num_experts` SwiGLU experts of
    # `moe_intermediate_size` units, `experts_per_token` of them per token. 0 experts = a dense model.
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k gates over the k (Qwen3-30B-A3B: true)
    # One layer in s is a mixture of experts, the last of each s (s - 1 dense MLPs of `intermediate_size` before
    # it; models/layer_stack.py). 1: every layer (Qwen3-30B-A3B).
    decoder_sparse_step: int = 1
    moe_impl: str = "sorted_tiles"  # how the experts' matmuls run (`model.moe_impl` resolved for the platform)
    moe_dispatch: str = "all_gather"  # with experts split over the mesh (`model.moe_dispatch` resolved)
    # The layer projections (and with int8_embeddings the embedding and lm_head) are int8 values with float32
    # scales: a sampler's copy (models/quantize.py).
    int8_weights: bool = False
    int8_embeddings: bool = False

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"LLMConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture '{self.architecture}'; supported: {SUPPORTED_ARCHITECTURES}")
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported rope type '{self.rope_type}'; supported: {SUPPORTED_ROPE_TYPES}")
        if self.attention not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(f"attention must be one of {ATTENTION_IMPLEMENTATIONS}, got '{self.attention}'")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"remat must be one of {REMAT_POLICIES}, got '{self.remat}'")
        for name in ("param_dtype", "compute_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"LLMConfig.{name} must be one of {DTYPES}, got '{getattr(self, name)}'")
        check_lora(self.lora_rank, self.lora_alpha, self.lora_targets)
        check_int8(self)
        if self.num_experts:
            if not 0 < self.experts_per_token <= self.num_experts or self.moe_intermediate_size < 1:
                raise ValueError(f"a mixture of experts needs 0 < experts_per_token ({self.experts_per_token}) <= "
                                 f"num_experts ({self.num_experts}) and moe_intermediate_size > 0 "
                                 f"({self.moe_intermediate_size})")
            if self.moe_impl not in MOE_IMPLEMENTATIONS:
                raise ValueError(f"moe_impl must be one of {tuple(MOE_IMPLEMENTATIONS)}, got '{self.moe_impl}'")
        if self.decoder_sparse_step < 1 or (self.decoder_sparse_step > 1 and not self.num_experts):
            raise ValueError(f"decoder_sparse_step {self.decoder_sparse_step}: 1, or more for a mixture of experts")
        if self.num_layers % self.decoder_sparse_step:
            raise ValueError(f"num_layers {self.num_layers} is not a multiple of decoder_sparse_step "
                             f"{self.decoder_sparse_step}: the layers scan as whole periods of dense layers then MoE")

    @property
    def lora_scale(self) -> float:
        return self.lora_alpha / self.lora_rank if self.lora_rank else 0.0

    @property
    def rope_params(self) -> dict[str, Any]:
        return dict(self.rope_scaling or ())

    @property
    def rope_type(self) -> str:
        params = self.rope_params
        return params.get("rope_type", params.get("type", "default"))
