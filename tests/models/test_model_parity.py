"""jgrpo's decoder against transformers on tiny random checkpoints of every supported family."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jgrpo.models.hf import load_model
from jgrpo.models.llm import ModelOptions, forward, merge_model, position_ids_from_mask
from tests.helpers_models import FAMILIES, hf_logits, jgrpo_logits, left_padded_batch, save_hf_model


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_match_transformers_on_left_padded_batch(family, tmp_path):
    model_dir, hf_model = save_hf_model(family, tmp_path / family)
    graphdef, params, cfg = load_model(str(model_dir))
    tokens, mask = left_padded_batch()
    ours = jgrpo_logits(graphdef, params, tokens, mask)
    ref = hf_logits(hf_model, tokens, mask)
    # Only real tokens are compared: what padding queries produce is irrelevant (and masked everywhere).
    np.testing.assert_allclose(ours[mask], ref[mask], atol=1e-4, rtol=0)
    assert np.abs(ref[mask]).max() > 0.5  # the comparison is not between near-zero logits


def test_config_fields_are_honoured(tmp_path):
    _, _, cfg = load_model(str(save_hf_model("llama3", tmp_path / "l")[0]))
    assert cfg.rope_theta == 500000.0 and cfg.rope_type == "llama3" and not cfg.tie_word_embeddings
    assert cfg.rope_params["original_max_position_embeddings"] == 8 and cfg.rms_norm_eps == 1e-5
    _, _, cfg = load_model(str(save_hf_model("qwen3", tmp_path / "q")[0]))
    assert cfg.head_dim == 24 and cfg.qk_norm and cfg.qkv_bias and cfg.o_bias and cfg.hidden_size == 64
    _, _, cfg = load_model(str(save_hf_model("qwen2", tmp_path / "q2")[0]))
    assert cfg.qkv_bias and not cfg.o_bias and cfg.tie_word_embeddings and cfg.rope_theta == 1e6


def test_padding_never_changes_real_token_logits(tmp_path):
    graphdef, params, _ = load_model(str(save_hf_model("qwen3", tmp_path / "q")[0]))
    tokens, mask = left_padded_batch(lengths=(7, 3))
    batched = jgrpo_logits(graphdef, params, tokens, mask)
    alone = jgrpo_logits(graphdef, params, tokens[1:, -3:], mask[1:, -3:])
    np.testing.assert_allclose(batched[1, -3:], alone[0], atol=1e-5, rtol=0)
    # Changing what sits in the padded slots changes nothing either.
    repadded = np.where(mask, tokens, 0)
    np.testing.assert_allclose(jgrpo_logits(graphdef, params, repadded, mask)[mask], batched[mask], atol=1e-6)


def test_bfloat16_compute_stays_close(tmp_path):
    model_dir, hf_model = save_hf_model("llama_tied", tmp_path / "m")
    graphdef, params, _ = load_model(str(model_dir), ModelOptions(param_dtype="bfloat16", compute_dtype="bfloat16"))
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
    tokens, mask = left_padded_batch()
    ours = jgrpo_logits(graphdef, params, tokens, mask)
    assert ours.dtype == np.float32
    np.testing.assert_allclose(ours[mask], hf_logits(hf_model, tokens, mask)[mask], atol=0.15, rtol=0)


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_policies_give_the_same_gradients(remat, tmp_path):
    model_dir = save_hf_model("qwen2", tmp_path / "m")[0]
    tokens, mask = (jnp.asarray(x) for x in left_padded_batch())

    def loss(params, graphdef):
        hidden, _ = forward(graphdef, params, tokens, position_ids_from_mask(mask), mask)
        return jnp.sum(jnp.where(mask[..., None], merge_model(graphdef, params).logits(hidden), 0.0) ** 2) * 1e-3

    g0, p0, _ = load_model(str(model_dir))
    g1, p1, _ = load_model(str(model_dir), ModelOptions(remat=remat))
    grads0 = jax.grad(loss)(p0, g0)
    grads1 = jax.grad(loss)(p1, g1)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5), grads0, grads1)
