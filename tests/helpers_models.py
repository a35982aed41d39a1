"""Tiny random transformers (PyTorch, float32) checkpoints and reference logits for model tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import transformers

VOCAB = 128

# One entry per family; each exercises the fields that family can set.
FAMILIES = {
    # Llama 3.x: rope scaling ("llama3") that bites at these positions, untied head, non-default theta.
    "llama3": dict(
        model_type="llama",
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8,
        },
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
    # SmolLM2-like: tied embeddings, theta 1e5.
    "llama_tied": dict(
        model_type="llama",
        num_attention_heads=4,
        num_key_value_heads=1,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    ),
    # Qwen2/2.5: q/k/v biases, o without.
    "qwen2": dict(
        model_type="qwen2",
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    # Qwen3: per-head q/k RMSNorm, head_dim (24) != hidden / heads (16), plus attention_bias on q/k/v/o.
    "qwen3": dict(
        model_type="qwen3",
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        attention_bias=True,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
    # Qwen3-MoE as Qwen3-30B-A3B sets it: gates renormalised over the top k, head_dim (24) != hidden / heads.
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
    # Qwen3-MoE with transformers' defaults: gates not renormalised, head_dim = hidden / heads, tied head.
    "qwen3_moe_plain": dict(
        model_type="qwen3_moe",
        num_attention_heads=4,
        num_key_value_heads=4,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
}


# Qwen3-MoE with a periodic stack: layers 1 and 3 of 4 mixtures of experts, 0 and 2 dense MLPs.
FAMILIES["qwen3_moe_step2"] = {**FAMILIES["qwen3_moe"], "num_hidden_layers": 4, "decoder_sparse_step": 2}


def make_hf_model(family: str, seed: int = 0, num_layers: int = 2):
    """A transformers model with *every* weight random (HF zero-inits biases and one-inits norms)."""
    kwargs = dict(FAMILIES[family])
    model_type = kwargs.pop("model_type")
    config = transformers.AutoConfig.for_model(
        model_type,
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=kwargs.pop("num_hidden_layers", num_layers),
        max_position_embeddings=256,
        **kwargs,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    return model


def save_hf_model(family: str, directory: Path, seed: int = 0) -> tuple[Path, object]:
    model = make_hf_model(family, seed)
    model.save_pretrained(directory)
    return Path(directory), model


def left_padded_batch(lengths=(7, 4, 1, 6), pad_id: int = 3, seed: int = 0):
    """tokens [B, T] int32 and mask [B, T] bool; pad_id also occurs inside real tokens on purpose."""
    rng = np.random.default_rng(seed)
    T = max(lengths)
    tokens = np.full((len(lengths), T), pad_id, np.int32)
    mask = np.zeros((len(lengths), T), bool)
    for row, n in enumerate(lengths):
        tokens[row, T - n :] = rng.integers(0, VOCAB, n)
        mask[row, T - n :] = True
    tokens[0, -2] = pad_id  # a real token equal to the pad id must still be attended to
    return tokens, mask


def positions_from_mask(mask: np.ndarray) -> np.ndarray:
    return np.maximum(np.cumsum(mask, axis=-1) - 1, 0).astype(np.int32)


def hf_logits(model, tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        out = model(
            input_ids=torch.as_tensor(tokens, dtype=torch.long),
            attention_mask=torch.as_tensor(mask, dtype=torch.long),
            position_ids=torch.as_tensor(positions_from_mask(mask), dtype=torch.long),
        )
    return out.logits.float().numpy()


def jgrpo_logits(graphdef, params, tokens, mask):
    """jgrpo's logits [B, T, V] for a left-padded batch, to hold against `hf_logits`."""
    import jax.numpy as jnp

    from jgrpo.models.llm import forward, merge_model, position_ids_from_mask

    tokens, mask = jnp.asarray(tokens), jnp.asarray(mask)
    hidden, _ = forward(graphdef, params, tokens, position_ids_from_mask(mask), mask)
    return np.asarray(merge_model(graphdef, params).logits(hidden))


# ------------------------------------------------------------------ the sampler tests' tiny models

SAMPLER_VOCAB = 96
SAMPLER_PROMPTS = [[5, 17, 33, 2, 41], [7, 8], [90, 12, 55, 61, 3, 19, 23, 4, 70], [11]]  # different lengths
SAMPLER_SEEDS = {"llama": 0, "qwen2": 1, "qwen3": 2}


def sampler_hf_config(family: str):
    common = dict(
        vocab_size=SAMPLER_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0,
        # A wide init makes logits decisive: greedy argmax gaps far above float32 noise.
        initializer_range=0.3, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    if family == "llama":
        return transformers.LlamaConfig(**common, tie_word_embeddings=True)
    if family == "qwen2":
        return transformers.Qwen2Config(**common, tie_word_embeddings=False, use_sliding_window=False)
    return transformers.Qwen3Config(**common, head_dim=16, tie_word_embeddings=False, use_sliding_window=False)


def sampler_model(family: str, directory: Path):
    """(torch model, (graphdef, params, cfg)) of one family with transformers' init, the same weights on both
    sides (saved in `directory` and loaded by jgrpo)."""
    from jgrpo.models.hf import load_model

    torch.manual_seed(SAMPLER_SEEDS[family])
    hf_model = transformers.AutoModelForCausalLM.from_config(sampler_hf_config(family)).eval()
    hf_model.save_pretrained(directory)
    return hf_model, load_model(str(directory))


def sampler_prompts(bucket: int = 4):
    """SAMPLER_PROMPTS left-padded (pad id 0) to a multiple of `bucket`: (tokens, mask)."""
    from jgrpo.data.prompts import left_pad

    return left_pad(SAMPLER_PROMPTS, pad_id=0, bucket=bucket)
