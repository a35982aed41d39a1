"""Int8 sampler weights (models/quantize.py): the round trip, the int8 matmul, and the sampler on an int8 copy."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jgrpo.models.llm import LLM, merge_model, position_ids_from_mask, split_model
from jgrpo.models.matmul import dense
from jgrpo.models.quantize import (
    PROJECTIONS,
    dequantize,
    quantize_params,
    quantize_weight,
    sampler_copy,
    scale_name,
    with_int8,
)
from jgrpo.sampling.sampler import Prompts, Sampler, SamplingMethod
from tests.models.test_model_cache import CFG, MOE_CFG


def test_round_trip_is_within_half_a_scale_step_per_channel_and_a_zero_channel_stays_finite():
    # Embeddings (per vocabulary row, tests below) go through the same quantize_over.
    rng = np.random.default_rng(0)
    w = rng.normal(size=(3, 8, 4, 5)).astype(np.float32) * rng.uniform(0.01, 10, size=(3, 1, 4, 5))  # o-like: 2 ins
    w[1, :, :, 2] = 0.0  # one all-zero output channel
    values, scale = quantize_weight(jnp.asarray(w), contract=2)
    assert values.dtype == jnp.int8 and scale.dtype == jnp.float32
    assert scale.shape == (3, 1, 1, 5)  # per layer and output channel; the input dims kept as 1s
    # By hand: the scale is the channel's absmax over both input dims / 127.
    np.testing.assert_allclose(scale[0, 0, 0, 0], np.abs(w[0, :, :, 0]).max() / 127, rtol=1e-6)
    error = np.abs(np.asarray(dequantize(values, scale)) - w)
    assert (error <= np.asarray(scale) / 2 * (1 + 1e-6)).all()
    assert int(np.abs(values).max()) == 127  # each channel's largest weight maps to +-127
    assert np.isfinite(np.asarray(scale)).all() and np.asarray(dequantize(values, scale))[1, :, :, 2].max() == 0


@pytest.mark.parametrize("contract", [1, 2])
def test_an_int8_matmul_equals_the_matmul_with_the_dequantized_weight(contract):
    rng = np.random.default_rng(1)
    shape = (1, 6, 4, 7) if contract == 2 else (1, 24, 7)
    values, scale = quantize_weight(jnp.asarray(rng.normal(size=shape), jnp.float32), contract)
    x = jnp.asarray(rng.normal(size=(2, 3, *shape[1:1 + contract])), jnp.float32)
    got = dense(x, values[0], contract, scale[0])
    want = dense(x, dequantize(values, scale)[0], contract)
    assert got.shape == (2, 3, 7)
    np.testing.assert_allclose(got, want, atol=1e-6 * float(jnp.abs(want).max()), rtol=0)


def _logprobs(model, prompts, out, G):
    """The trainer's view: the completion tokens' log-probs under `model`'s full forward, [R, N]."""
    P = prompts.tokens.shape[1]
    seq = jnp.concatenate([jnp.repeat(prompts.tokens, G, 0), out.tokens], 1)
    mask = jnp.concatenate([jnp.repeat(prompts.mask, G, 0), out.completion_mask], 1)
    hidden = model(seq, position_ids_from_mask(mask), mask)[0]
    logprobs = jax.nn.log_softmax(model.logits(hidden[:, P - 1:-1]).astype(jnp.float32), -1)
    return np.take_along_axis(np.asarray(logprobs), np.asarray(out.tokens)[..., None], -1)[..., 0]


def _dequantized(params, copy):
    """`params` with every int8 leaf of `copy` replaced by its dequantized value (the model the copy stands for)."""
    layers = {n: dequantize(copy["layers"][n], copy["layers"][scale_name(n)]) for n in PROJECTIONS}
    top = {n: dequantize(copy[n], copy[scale_name(n)]) for n in ("embed", "lm_head") if scale_name(n) in copy}
    return {**params, **top, "layers": {**params["layers"], **layers}}


@pytest.mark.parametrize(("decode_layers", "embeddings", "tied"), [
    ("unrolled", False, False), ("scanned", False, False), ("unrolled", True, False), ("scanned", True, True)])
def test_the_int8_samplers_logprobs_are_the_dequantized_models(decode_layers, embeddings, tied):
    # Float32 compute: what an int8 copy samples is exactly the model whose weights are the dequantized values,
    # and that model differs from the float one by more than the float sampler does. With quantize_embeddings the
    # lookup and the lm_head (tied: the embedding's row scales serve both) are int8 too.
    cfg = dataclasses.replace(CFG, tie_word_embeddings=tied)
    graphdef, params = split_model(LLM(cfg, rngs=nnx.Rngs(0)))
    quantized = sampler_copy("int8", "float32", embeddings)(params)
    assert {scale_name(n) for n in PROJECTIONS} <= set(quantized["layers"])
    assert (quantized["embed"].dtype == jnp.int8) == embeddings and ("lm_head_scale" in quantized) == (embeddings
                                                                                                      and not tied)
    rng = np.random.default_rng(0)
    mask = np.arange(6)[None] >= np.array([[0], [3]])  # real lengths 6 and 3
    prompts = Prompts(np.where(mask, rng.integers(1, CFG.vocab_size, (2, 6)), 0).astype(np.int32), mask)
    G = 2
    sampler = Sampler(graphdef, max_new_tokens=8, num_samples=G, method=SamplingMethod(temperature=1.0),
                      decode_layers=decode_layers)
    out = jax.device_get(sampler.generate(quantized, prompts, jax.random.key(0)))  # the same sampler, int8 params
    drawn = out.completion_mask
    dequantized = merge_model(graphdef, _dequantized(params, quantized))
    assert np.abs(_logprobs(dequantized, prompts, out, G) - out.logprobs)[drawn].max() <= 1e-4
    float_out = jax.device_get(sampler.generate(params, prompts, jax.random.key(0)))  # and float params after it
    float_gap = np.abs(_logprobs(merge_model(graphdef, params), prompts, float_out, G) - float_out.logprobs)
    quantization = np.abs(_logprobs(merge_model(graphdef, params), prompts, out, G) - out.logprobs)[drawn]
    assert float_gap[float_out.completion_mask].max() < 1e-5 < quantization.mean()


def test_the_int8_copy_keeps_norms_biases_embeddings_and_adapters_float_in_the_compute_dtype():
    cfg = dataclasses.replace(CFG, lora_rank=2, lora_targets=("q", "down"))
    _, params = split_model(LLM(cfg, rngs=nnx.Rngs(0)))
    copy = quantize_params(params, "bfloat16")
    layers = copy["layers"]
    assert {n for n, w in layers.items() if w.dtype == jnp.int8} == set(PROJECTIONS)
    assert {n for n, w in layers.items() if w.dtype == jnp.float32} == {scale_name(n) for n in PROJECTIONS}
    others = [copy["embed"], copy["final_norm"], layers["attn_norm"], layers["q_lora_a"], layers["down_lora_b"]]
    assert all(w.dtype == jnp.bfloat16 for w in others)
    # A LoRA run's adapters alone (what trains): cast, nothing to quantize.
    adapters = {"layers": {n: w for n, w in params["layers"].items() if "_lora_" in n}}
    assert {w.dtype for w in jax.tree.leaves(quantize_params(adapters, "bfloat16"))} == {jnp.dtype(jnp.bfloat16)}


def test_an_int8_mixture_of_experts_is_refused_naming_the_reason():
    with pytest.raises(ValueError, match="int8 weights on a mixture of experts"):
        with_int8(MOE_CFG)


def test_quantized_embeddings_need_int8_weights_and_an_unknown_dtype_lists_the_values():
    from jgrpo.config import ConfigError
    from jgrpo.config.loading import load_config

    with pytest.raises(ConfigError, match=r"sampler.quantize_embeddings=True .* sampler.weights_dtype=bfloat16"):
        load_config("configs/tiny.yaml", ["sampler.quantize_embeddings=true", "sampler.weights_dtype=bfloat16"])
    with pytest.raises(ConfigError, match="sampler.weights_dtype='int4' .* 'float32', 'bfloat16', 'int8'"):
        load_config("configs/tiny.yaml", ["sampler.weights_dtype=int4"])
    with pytest.raises(ConfigError, match="sampler.kv_cache_dtype='int4' .* 'auto', 'float32', 'bfloat16', 'int8'"):
        load_config("configs/tiny.yaml", ["sampler.kv_cache_dtype=int4"])

