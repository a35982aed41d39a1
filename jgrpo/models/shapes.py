"""Model shape descriptions without weights: what the planner needs to compile for a model it cannot download.

A model's shape is its `config.json`. For a local directory or a built-in that is on disk already, it is read
from there; for the hub ids the shipped configs name (and a few more for coverage) the values that change
the computation are stored below, copied from each model's `config.json` on the Hugging Face hub, so
`model_shapes("Qwen/Qwen2.5-0.5B-Instruct")` works on a machine with no network. Names match with or
without the organisation prefix, case-insensitively.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jgrpo.models.hf_format import llm_config_from_hf
from jgrpo.models.llm import LLMConfig, ModelOptions

_QWEN_VOCAB = 151936

# config.json values (only those llm_config_from_hf reads), per hub id.
KNOWN_SHAPES: dict[str, dict[str, Any]] = {
    "HuggingFaceTB/SmolLM2-135M-Instruct": dict(
        model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True),
    "Qwen/Qwen2.5-0.5B-Instruct": dict(
        model_type="qwen2", vocab_size=_QWEN_VOCAB, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=32768, tie_word_embeddings=True),
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B": dict(
        model_type="qwen2", vocab_size=_QWEN_VOCAB, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
        num_attention_heads=12, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=131072, tie_word_embeddings=False),
    "meta-llama/Llama-3.2-1B": dict(
        model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
        rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=True),
    "Qwen/Qwen3-0.6B": dict(
        model_type="qwen3", vocab_size=_QWEN_VOCAB, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=40960, tie_word_embeddings=True),
    "Qwen/Qwen3-1.7B": dict(
        model_type="qwen3", vocab_size=_QWEN_VOCAB, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=40960, tie_word_embeddings=True),
    # Mixtures of experts: 128 experts, 8 per token, gates renormalised over the 8, every layer sparse.
    "Qwen/Qwen3-30B-A3B": dict(
        model_type="qwen3_moe", vocab_size=_QWEN_VOCAB, hidden_size=2048, intermediate_size=6144,
        moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=False),
    "Qwen/Qwen3-235B-A22B": dict(
        model_type="qwen3_moe", vocab_size=_QWEN_VOCAB, hidden_size=4096, intermediate_size=12288,
        moe_intermediate_size=1536, num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=False),
}
# The built-in names (jgrpo.models.builtin) that are shapes of a hub model.
_ALIASES = {"smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}
_TINY = ("tiny-random-llama", "tiny-random-qwen3-moe")  # built-ins with no hub model


def _key(name: str) -> str:
    return name.strip().rstrip("/").split("/")[-1].lower()


_BY_KEY = {_key(hub_id): hub_id for hub_id in KNOWN_SHAPES} | {_key(a): h for a, h in _ALIASES.items()}


def hf_shape_dict(name: str) -> dict[str, Any]:
    """The config.json dict of `name`: a local HF directory's own, else a shipped one (no download, no weights)."""
    path = Path(name).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return json.loads((path / "config.json").read_text())
    hub_id = _BY_KEY.get(_key(name))
    if hub_id is None:
        if name in _TINY:
            from jgrpo.models.builtin import resolve_model_dir  # generated locally in seconds, no download

            return json.loads((resolve_model_dir(name) / "config.json").read_text())
        raise ValueError(f"no shape description for model '{name}': give a local HF directory with a config.json, "
                         f"or one of {sorted(KNOWN_SHAPES) + sorted(_ALIASES) + list(_TINY)}")
    return dict(KNOWN_SHAPES[hub_id])


def model_shapes(name: str, options: ModelOptions = ModelOptions()) -> LLMConfig:
    """The LLMConfig of `name` from its shape description alone (see `hf_shape_dict`), with a run's `options`."""
    return llm_config_from_hf(hf_shape_dict(name), options)
