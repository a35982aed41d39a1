"""The policy / behaviour / reference model: a Flax NNX decoder plus HF and GGUF checkpoint I/O."""

from jgrpo.models.builtin import BUILTIN_MODELS, cache_dir, resolve_model_dir
from jgrpo.models.hf import export_hf, hf_config_from_llm, llm_config_from_hf, load_model, load_params, load_tokenizer
from jgrpo.models.llm import (
    LLM,
    KVCache,
    LLMConfig,
    forward,
    init_cache,
    merge_model,
    param_logical_axes,
    position_ids_from_mask,
    split_model,
)

__all__ = [
    "BUILTIN_MODELS",
    "LLM",
    "KVCache",
    "LLMConfig",
    "cache_dir",
    "export_hf",
    "forward",
    "hf_config_from_llm",
    "init_cache",
    "llm_config_from_hf",
    "load_model",
    "load_params",
    "load_tokenizer",
    "merge_model",
    "param_logical_axes",
    "position_ids_from_mask",
    "resolve_model_dir",
    "split_model",
]
