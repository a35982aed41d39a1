"""Each prompt computed once for its G completions gives the numbers of the plain [prompt | completion] rows."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jgrpo.training.padded_layout as padded_layout_module
from jgrpo.config import GRPOConfig, MeshConfig
from jgrpo.models.llm import LLM, LLMConfig, merge_model, position_ids_from_mask, split_model
from jgrpo.models.moe import router_losses
from jgrpo.models.shared_prompt import forward_shared_prompts
from jgrpo.parallel.mesh import make_mesh
from jgrpo.sampling.methods import SamplingMethod
from jgrpo.training.step_options import StepOptions
from jgrpo.training.steps import StepFunctions
from tests.helpers import sampled

GQA = LLMConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4, num_kv_heads=2,
                head_dim=16, rope_theta=100000.0, qkv_bias=True, qk_norm=True)
CONFIGS = {
    "gqa_bias_qknorm": GQA,
    "one_kv_head_tied": dataclasses.replace(GQA, num_kv_heads=1, qkv_bias=False, qk_norm=False,
                                            tie_word_embeddings=True),
    "remat_full": dataclasses.replace(GQA, remat="full"),
}
PROMPTS, G, P, N = 3, 4, 7, 6


def _batch(seed=0):
    """Left-padded prompts (lengths 7, 3, 5), completions with stops; rows b*G ... b*G+G-1 share prompt b."""
    rng = np.random.default_rng(seed)
    prompt_tokens = rng.integers(0, 128, (PROMPTS, P)).astype(np.int32)
    prompt_mask = np.arange(P)[None, :] >= np.array([[0], [4], [2]])
    tokens = rng.integers(0, 128, (PROMPTS * G, N)).astype(np.int32)
    completion_mask = np.arange(N)[None, :] < rng.integers(1, N + 1, (PROMPTS * G, 1))
    return prompt_tokens, prompt_mask, tokens, completion_mask


def _full_rows(prompt_tokens, prompt_mask, tokens, completion_mask):
    seq = np.concatenate([np.repeat(prompt_tokens, G, axis=0), tokens], axis=1)
    mask = np.concatenate([np.repeat(prompt_mask, G, axis=0), completion_mask], axis=1)
    return jnp.asarray(seq), jnp.asarray(mask), position_ids_from_mask(jnp.asarray(mask))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_hidden_states_and_gradients_match_the_full_forward(name):
    graphdef, params = split_model(LLM(CONFIGS[name], rngs=nnx.Rngs(params=3)))
    prompt_tokens, prompt_mask, tokens, completion_mask = _batch()
    seq, mask, positions = _full_rows(prompt_tokens, prompt_mask, tokens, completion_mask)
    weights = jax.random.normal(jax.random.key(1), (PROMPTS * G, N, GQA.hidden_size)) * completion_mask[..., None]

    def full(params):
        hidden, _ = merge_model(graphdef, params)(seq, positions, mask)
        return hidden

    def shared(params):
        return forward_shared_prompts(merge_model(graphdef, params), prompt_tokens, prompt_mask, tokens,
                                      completion_mask, positions[:, P:])

    reference = jax.jit(full)(params)
    prompt_hidden, completion_hidden, _ = jax.jit(shared)(params)
    np.testing.assert_allclose(prompt_hidden[prompt_mask], reference[::G, :P][prompt_mask], atol=1e-5, rtol=0)
    np.testing.assert_allclose(completion_hidden[completion_mask], reference[:, P:][completion_mask],
                               atol=1e-5, rtol=0)

    # The gradient reaches the weights through the shared prompt keys/values of all G rows.
    grad_full = jax.jit(jax.grad(lambda p: jnp.sum(full(p)[:, P:] * weights)))(params)
    grad_shared = jax.jit(jax.grad(lambda p: jnp.sum(shared(p)[1] * weights)))(params)
    for path, a in jax.tree_util.tree_leaves_with_path(grad_full):
        b = _leaf(grad_shared, path)
        if path[0].key != "lm_head":  # the only weight that hidden states do not depend on
            assert float(jnp.linalg.norm(a)) > 0, jax.tree_util.keystr(path)
        np.testing.assert_allclose(b, a, atol=1e-5 * float(jnp.max(jnp.abs(a))), rtol=1e-4,
                                   err_msg=jax.tree_util.keystr(path))


def test_a_mixture_of_experts_routes_and_replays_as_the_full_rows():
    # The router 30x wider than its init: top-k margins far above rounding, so both forwards route alike.
    # A periodic stack (4 layers, 0 and 2 dense, 1 and 3 mixtures of experts): both kinds of layer in one scan.
    cfg = dataclasses.replace(GQA, architecture="qwen3_moe", num_experts=8, experts_per_token=2,
                              moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=2,
                              num_layers=4)
    graphdef, params = split_model(LLM(cfg, rngs=nnx.Rngs(params=3)))
    params["layers"]["router"] = params["layers"]["router"] * 30
    model = merge_model(graphdef, params)
    prompt_tokens, prompt_mask, tokens, completion_mask = _batch()
    seq, mask, positions = _full_rows(prompt_tokens, prompt_mask, tokens, completion_mask)
    full, _, routing, full_stats = model.routed(seq, positions, mask, router_stats=True)
    _, completion, (prompt_ids, completion_ids), stats = forward_shared_prompts(
        model, prompt_tokens, prompt_mask, tokens, completion_mask, positions[:, P:], router_stats=True)
    # The router's statistics count each prompt token G times, as the full rows do: the same router losses.
    np.testing.assert_allclose(router_losses(stats), router_losses(full_stats), rtol=1e-5)
    np.testing.assert_allclose(stats.tokens, full_stats.tokens)
    np.testing.assert_array_equal(prompt_ids[prompt_mask], routing[::G, :P][prompt_mask])
    np.testing.assert_array_equal(completion_ids[completion_mask], routing[:, P:][completion_mask])
    # Replaying other experts (every layer takes the next layer's) gives what the full rows give with them.
    other = jnp.roll(routing, 1, axis=2)
    replayed_full, _, chosen_full = model.routed(seq, positions, mask, routing=other)
    _, replayed, (_, replayed_ids) = forward_shared_prompts(
        model, prompt_tokens, prompt_mask, tokens, completion_mask, positions[:, P:],
        routing=(other[::G, :P], other[:, P:]))
    # Both return what their router picks under the replay (the replay's overrides are where it differs from other).
    np.testing.assert_array_equal(replayed_ids[completion_mask], chosen_full[:, P:][completion_mask])
    assert (replayed_ids[completion_mask] != other[:, P:][completion_mask]).any()
    np.testing.assert_allclose(replayed[completion_mask], replayed_full[:, P:][completion_mask], atol=1e-5, rtol=0)
    assert float(jnp.abs(replayed - completion)[completion_mask].max()) > 1e-3


def _leaf(tree, path):
    for key in path:
        tree = tree[key.key]
    return tree


def test_rows_must_be_whole_groups():
    graphdef, params = split_model(LLM(GQA, rngs=nnx.Rngs(params=0)))
    prompt_tokens, prompt_mask, tokens, completion_mask = _batch()
    with pytest.raises(ValueError, match="whole number of groups"):
        forward_shared_prompts(merge_model(graphdef, params), prompt_tokens, prompt_mask, tokens[:-1],
                               completion_mask[:-1], jnp.zeros((PROMPTS * G - 1, N), jnp.int32))


@pytest.mark.parametrize(("micro_batches", "shares"), [(1, True), (6, False)],
                         ids=["chunks_of_whole_groups", "chunks_split_groups"])
def test_step_functions_agree_with_and_without_sharing(micro_batches, shares, monkeypatch):
    """On the 8-device mesh: log-probs and one optimiser step (loss, gradient norm, new params) agree.

    12 rows in one micro-batch are three whole groups of G=4: the prompts are shared. In 6 micro-batches of
    2 rows a group spans chunks: the step falls back to plain rows.
    """
    calls = []

    def counted(*args):
        calls.append(1)
        return forward_shared_prompts(*args)

    monkeypatch.setattr(padded_layout_module, "forward_shared_prompts", counted)
    graphdef, params = split_model(LLM(GQA, rngs=nnx.Rngs(params=5)))
    prompt_tokens, prompt_mask, tokens, completion_mask = _batch(seed=1)
    grpo = GRPOConfig(num_generations=G, beta=0.04, micro_batches=micro_batches)
    rng = np.random.default_rng(2)
    rewards = rng.integers(0, 2, PROMPTS * G).astype(np.float32)
    lp_alpha = jnp.asarray(rng.normal(size=tokens.shape) - 3.0, jnp.float32)
    results = {}
    for share in (True, False):
        options = StepOptions(grpo=grpo, method=SamplingMethod(temperature=0.7), logprob_chunk=4, new_tokens=N,
                              share_prompts=share)
        steps = StepFunctions(graphdef=graphdef, params=params, mesh=make_mesh(MeshConfig()), options=options,
                              optimizer=optax.sgd(1.0))  # new params = params - gradient (Adam would hide it)
        placed = steps.copy_params(params)  # placed on the mesh, new buffers: the train step donates them
        batch, _ = steps.assemble(prompt_tokens, prompt_mask, sampled(tokens, completion_mask, lp_alpha), rewards)
        lp = steps.passes.pi_k(placed, batch)
        batch = batch._replace(lp_ref=lp - 0.1)
        new_params, _, metrics = steps.updates.step(placed, steps.init_opt_state(placed), batch, jnp.int32(0),
                                                    jnp.bool_(True))
        results[share] = (lp, metrics, new_params)
    assert bool(calls) == shares  # traced once per program when the prompts are shared, never otherwise
    (lp_s, m_s, p_s), (lp_f, m_f, p_f) = results[True], results[False]
    real = np.asarray(completion_mask).reshape(lp_s.shape)
    np.testing.assert_allclose(np.asarray(lp_s)[real], np.asarray(lp_f)[real], atol=1e-5, rtol=0)
    np.testing.assert_allclose(m_s["loss"], m_f["loss"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(m_s["grad_norm"], m_f["grad_norm"], rtol=1e-4)
    assert float(m_s["grad_norm"]) > 0
    for before, a, b in zip(jax.tree.leaves(params), jax.tree.leaves(p_s), jax.tree.leaves(p_f), strict=True):
        grad_shared, grad_full = np.asarray(before - a), np.asarray(before - b)
        np.testing.assert_allclose(grad_shared, grad_full, atol=5e-7, rtol=1e-4)  # 5e-7: rounding of p - (p - g)


def test_assemble_takes_the_reward_table_and_filters_overlong_rows():
    # Rows cut at max_new_tokens leave the loss with grpo.overlong_filter (their rewards still shape the group's
    # advantages); per-reward advantages read the table's columns with the run's weights.
    graphdef, params = split_model(LLM(GQA, rngs=nnx.Rngs(params=0)))
    prompt_tokens, prompt_mask, tokens, completion_mask = _batch(seed=3)
    lp_alpha = jnp.zeros(tokens.shape, jnp.float32)
    total = jnp.array([1.0, 0, 0, 1, 1, 1, 1, 1, 0, 1, 0, 0])  # group 1 has zero variance
    table = jnp.stack([total, total], axis=1)  # one function, weight 1
    truncated = jnp.array([True, False, False, False, False, False, False, True, False, False, True, True])
    for overlong_filter, normalisation in ((False, "sum"), (True, "sum"), (True, "per_reward")):
        grpo = GRPOConfig(num_generations=G, overlong_filter=overlong_filter,
                          advantage_reward_normalisation=normalisation)
        options = StepOptions(grpo=grpo, method=SamplingMethod(temperature=0.7), logprob_chunk=4, new_tokens=N,
                              reward_weights=(1.0,))
        steps = StepFunctions(graphdef=graphdef, params=params, mesh=make_mesh(MeshConfig()), options=options,
                              optimizer=optax.sgd(1.0))
        _, adv = steps.assemble(prompt_tokens, prompt_mask, sampled(tokens, completion_mask, lp_alpha, truncated),
                                table)
        live = np.repeat([True, False, True], G)
        np.testing.assert_array_equal(adv.in_loss, live & ~np.asarray(truncated) if overlong_filter else live)
        plain = np.asarray(adv.advantages)
        assert plain[0] > 0 and plain[1] < 0 and (plain[4:8] == 0).all()  # the truncated row 0 keeps its A
