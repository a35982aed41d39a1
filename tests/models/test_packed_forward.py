"""The packed shared-prompt forward (models/packed_forward.py) gives the padded one's numbers: every real prompt and
completion token's hidden state, the hidden state that predicts each completion token, the router's experts of a
mixture of experts, and the gradients of any loss on them. Packed by training/packing.py's plan."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jgrpo.models.llm import LLM, merge_model, split_model
from jgrpo.models.packed_forward import PackedStreams, forward_packed, packed_masks, predecessor_hidden
from jgrpo.models.shared_prompt import forward_shared_prompts
from jgrpo.training.packed_passes import plan_batch
from jgrpo.training.packing import PackedSizes, PackingPlan, pack, pack_prompts, unpack
from tests.models.test_model_cache import MOE_CFG
from tests.models.test_shared_prompt import GQA, PROMPTS, G, N, P, _batch

# Remat is the layer scan's (shared with the padded forward, tested with it in tests/models/test_shared_prompt.py).
CONFIGS = {"gqa_bias_qknorm": GQA, "moe": dataclasses.replace(MOE_CFG, vocab_size=128)}


def _packed(prompt_tokens, prompt_mask, tokens, completion_mask, K=3, W=24, Kp=2, Wp=8):
    """The batch as one packed micro-batch, planned as the trainer plans it (`packed_passes.plan_batch`): the
    forward's inputs, the plan, and the predecessor lookups (each token's index j, its prompt's last slot)."""
    packed = plan_batch(PackedSizes(K, W, Kp, Wp, micro_batches=1, shards=1), prompt_tokens, prompt_mask, tokens,
                        completion_mask, G)
    m = jax.tree.map(lambda x: x[0], packed._replace(count=None))
    plan = PackingPlan(np.asarray(packed.row), np.asarray(packed.index), np.asarray(packed.segment),
                       int(packed.count), np.asarray(packed.prompt_group), np.asarray(packed.prompt_positions))
    inputs = dict(prompt_tokens=m.prompt_tokens, prompt_group=m.prompt_group, prompt_positions=m.prompt_positions,
                  completion_tokens=m.tokens, completion_group=m.group, completion_segment=m.segment,
                  completion_positions=m.positions, prompt_row=m.prompt_row)
    return inputs, plan, m.index, m.prompt_last


def test_the_masks_by_hand():
    # Prompt block [[p0 p0 | p1]], completions [[c0 c0 c1], [c2 _ _]]: c0, c1 of prompt 0, c2 of prompt 1; both
    # rows' groups' prompts sit in prompt row 0.
    prompt_allowed, completion_allowed = packed_masks(
        jnp.asarray([[0, 0, 1]]), jnp.asarray([[0, 0, 0], [1, -1, -1]]), jnp.asarray([[1, 1, 2], [1, 0, 0]]),
        jnp.asarray([0, 0]))
    np.testing.assert_array_equal(prompt_allowed[0], [[1, 0, 0], [1, 1, 0], [0, 0, 1]])
    np.testing.assert_array_equal(completion_allowed[0], [[1, 1, 0, 1, 0, 0], [1, 1, 0, 1, 1, 0],
                                                          [1, 1, 0, 0, 0, 1]])  # c1 sees p0, not c0
    np.testing.assert_array_equal(completion_allowed[1], [[0, 0, 1, 1, 0, 0], [0] * 6, [0] * 6])


def test_a_completion_sees_nothing_of_another(monkeypatch):
    # Another completion's tokens (even of its own group, in its own row) and another group's prompt leave every
    # other completion's hidden states bit for bit; without the segment restriction the first no longer holds.
    import jgrpo.models.packed_forward as module

    graphdef, params = split_model(LLM(GQA, rngs=nnx.Rngs(params=3)))
    model = merge_model(graphdef, params)
    prompt_tokens, prompt_mask, tokens, completion_mask = _batch()
    completion_mask[:G] = np.arange(N) < 3  # group 0's four completions share one row
    inputs, plan, _, _ = _packed(prompt_tokens, prompt_mask, tokens, completion_mask)
    assert len(set(plan.segment[0, 0])) > 2  # row 0 holds several of group 0's completions

    def hidden(**changed):
        _, completion, _ = forward_packed(model, PackedStreams(**{**inputs, **changed}))  # traced anew: patched masks
        return np.asarray(unpack(completion[None], plan, PROMPTS * G, N))

    before = hidden()
    other = np.asarray(inputs["completion_tokens"]).copy()
    other[plan.row[0] == 0] = (other[plan.row[0] == 0] + 1) % 128  # completion 0's tokens
    others = np.ones(PROMPTS * G, bool)
    others[0] = False
    real = np.asarray(completion_mask)
    after = hidden(completion_tokens=jnp.asarray(other))
    np.testing.assert_array_equal(after[others][real[others]], before[others][real[others]])
    prompt = np.asarray(inputs["prompt_tokens"]).copy()
    prompt[plan.prompt_group[0] == 2] += 1  # group 2's prompt
    after = hidden(prompt_tokens=jnp.asarray(prompt))
    np.testing.assert_array_equal(after[: 2 * G][real[: 2 * G]], before[: 2 * G][real[: 2 * G]])
    assert not np.array_equal(after[2 * G:][real[2 * G:]], before[2 * G:][real[2 * G:]])

    def without_segments(prompt_group, completion_group, completion_segment, *rest):
        return packed_masks(prompt_group, completion_group, (completion_segment > 0).astype(jnp.int32), *rest)

    monkeypatch.setattr(module, "packed_masks", without_segments)
    before = hidden()
    after = hidden(completion_tokens=jnp.asarray(other))
    same_row = (np.arange(PROMPTS * G) > 0) & (np.arange(PROMPTS * G) < G)  # completions 1-3: after it in row 0
    assert not np.array_equal(after[same_row][real[same_row]], before[same_row][real[same_row]])


@pytest.mark.parametrize("name", list(CONFIGS))
def test_hidden_states_predecessors_experts_and_gradients_match_the_padded_forward(name):
    cfg = CONFIGS[name]
    graphdef, params = split_model(LLM(cfg, rngs=nnx.Rngs(params=3)))
    prompt_tokens, prompt_mask, tokens, completion_mask = _batch()
    inputs, plan, j, prompt_last = _packed(prompt_tokens, prompt_mask, tokens, completion_mask)
    assert plan.micro_batches == 1  # each group's 4 completions (<= 24 tokens) in one row of 24: a row a group
    assert all(len(set(plan.row[0, k][plan.row[0, k] >= 0] // G)) == 1 for k in range(3))
    D = cfg.hidden_size
    weights = jax.random.normal(jax.random.key(1), (PROMPTS * G, N, D)) * completion_mask[..., None]
    prompt_weights = jax.random.normal(jax.random.key(2), (PROMPTS, P, D)) * prompt_mask[..., None]
    lengths = prompt_mask.sum(1)

    def padded(params):
        prompt, completion, ids = forward_shared_prompts(merge_model(graphdef, params), jnp.asarray(prompt_tokens),
                                                         jnp.asarray(prompt_mask), jnp.asarray(tokens),
                                                         jnp.asarray(completion_mask),
                                                         jnp.asarray(lengths.repeat(G)[:, None] + np.arange(N)))
        loss = jnp.sum(completion * weights) + jnp.sum(prompt * prompt_weights)
        before = jnp.concatenate([jnp.repeat(prompt[:, -1:], G, axis=0), completion[:, :-1]], axis=1)
        return loss, (prompt, completion, before, ids)

    def packed(params):
        prompt, completion, ids = forward_packed(merge_model(graphdef, params), PackedStreams(**inputs))
        loss = jnp.sum(completion * pack(weights, plan)[0]) + jnp.sum(prompt * pack_prompts(prompt_weights, plan,
                                                                                               lengths)[0])
        return loss, (prompt, completion, predecessor_hidden(prompt, completion, j, prompt_last), ids)

    (want_loss, (want_p, want_c, want_before, want_ids)), want_grads = jax.jit(jax.value_and_grad(
        padded, has_aux=True))(params)
    (got_loss, (got_p, got_c, got_before, got_ids)), got_grads = jax.jit(jax.value_and_grad(
        packed, has_aux=True))(params)
    real = np.asarray(completion_mask)
    np.testing.assert_allclose(np.asarray(unpack(got_c[None], plan, PROMPTS * G, N))[real],
                               np.asarray(want_c)[real], atol=2e-5)
    np.testing.assert_allclose(np.asarray(unpack(got_before[None], plan, PROMPTS * G, N))[real],
                               np.asarray(want_before)[real], atol=2e-5)
    real_prompt = plan.prompt_group >= 0  # each real prompt token once, against the padded forward's
    np.testing.assert_allclose(np.asarray(got_p)[real_prompt[0]],
                               np.asarray(pack_prompts(want_p, plan, lengths))[real_prompt], atol=2e-5)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-4, rtol=2e-4)
    if cfg.num_experts:
        got = np.asarray(unpack(got_ids[1][None], plan, PROMPTS * G, N))[real]
        np.testing.assert_array_equal(np.sort(got, -1), np.sort(np.asarray(want_ids[1])[real], -1))
    else:
        assert got_ids is None and want_ids is None


def test_splash_gives_the_custom_attention_numbers():
    """On TPU the packed forward runs splash with each row's mask as data (here in Pallas interpret mode): the same
    hidden states and gradients as the `custom` attention's masks."""
    graphdef, params = split_model(LLM(GQA, rngs=nnx.Rngs(params=3)))
    splash, _ = split_model(LLM(dataclasses.replace(GQA, attention="splash"), rngs=nnx.Rngs(params=3)))
    prompt_tokens, prompt_mask, tokens, completion_mask = _batch()
    completion_mask[:G] = np.arange(N) < 3  # group 0's four completions share one row
    inputs, plan, _, _ = _packed(prompt_tokens, prompt_mask, tokens, completion_mask)
    weights = jax.random.normal(jax.random.key(1), (3, 24, GQA.hidden_size))

    def run(graphdef):
        def loss(params):
            prompt, completion, _ = forward_packed(merge_model(graphdef, params), PackedStreams(**inputs))
            return jnp.sum(jnp.where(inputs["completion_group"][..., None] >= 0, completion, 0) * weights), completion

        return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

    (want_loss, want), want_grads = run(graphdef)
    (got_loss, got), got_grads = run(splash)
    real = np.asarray(inputs["completion_group"]) >= 0
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=2e-5)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-4, rtol=2e-4)
