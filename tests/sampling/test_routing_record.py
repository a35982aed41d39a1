"""A mixture of experts' sampler records the experts of every position it runs (prompt, fed tokens, appended tokens),
and the trainer's full forward replaying that record reproduces the sampler's log-probs (routing replay, R3)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jgrpo.models.llm import LLM, merge_model, position_ids_from_mask, split_model
from jgrpo.rl.routing_replay import sampler_ran, sequence_routing
from jgrpo.sampling.sampler import Prompts, Sampler, SamplingMethod
from jgrpo.sampling.turns import PAUSED
from tests.models.test_model_cache import MOE_CFG

METHOD = SamplingMethod(temperature=1.0)


def _model(compute_dtype="float32"):
    return split_model(LLM(dataclasses.replace(MOE_CFG, compute_dtype=compute_dtype), rngs=nnx.Rngs(0)))


def _prompts(batch=3, width=6):
    rng = np.random.default_rng(0)
    mask = np.arange(width)[None] >= (np.arange(batch) * 2 % width)[:, None]  # real lengths 6, 4, 2, ...
    return Prompts(np.where(mask, rng.integers(1, MOE_CFG.vocab_size, (batch, width)), 0).astype(np.int32), mask)


def _full_forward(graphdef, params, prompts, out, G, routing=None):
    """The trainer's view of every row: (the router's experts [R, P + N, L, k], the tokens' log-probs [R, N])."""
    seq = np.concatenate([np.repeat(prompts.tokens, G, 0), out.tokens], 1)
    mask = np.concatenate([np.repeat(prompts.mask, G, 0), out.completion_mask], 1)
    chosen, logprobs = _routed(graphdef, params, seq, mask, prompts.tokens.shape[1], routing)
    return np.asarray(chosen), np.take_along_axis(np.asarray(logprobs), np.asarray(out.tokens)[..., None], -1)[..., 0]


@functools.partial(jax.jit, static_argnums=(0, 4))  # one program: op by op, the MoE forward took seconds a call
def _routed(graphdef, params, seq, mask, P, routing):
    model = merge_model(graphdef, params)
    hidden, _, chosen = model.routed(seq, position_ids_from_mask(mask), mask, routing=routing)
    return chosen, jax.nn.log_softmax(model.logits(hidden[:, P - 1:-1]).astype(jnp.float32), -1)


def _recorded(out):
    return np.concatenate([out.prompt_routing, out.routing], 1).astype(np.int32)


def _ran(prompts, out, G):
    """[R, P + N]: the positions the sampler ran (every real prompt token, every token but a row's last)."""
    N = out.tokens.shape[1]
    return np.concatenate([np.repeat(prompts.mask, G, 0), np.arange(N)[None] < np.asarray(out.lengths)[:, None] - 1], 1)


def _same_sets(a, b):
    return (np.sort(a, -1) == np.sort(b, -1)).all(-1)  # [..., L]


def test_the_record_is_the_full_forwards_routing_and_replaying_it_gives_the_sampled_logprobs():
    # Continuous batching (refilled slots) with the scanned decode step; static batching and the unrolled step
    # are the tiny MoE training run's (tests/training/test_moe_training.py).
    graphdef, params = _model()
    prompts, G = _prompts(), 2
    sampler = Sampler(graphdef, max_new_tokens=7, num_samples=G, method=METHOD, slots=3, decode_layers="scanned")
    out = jax.device_get(sampler.generate(params, prompts, jax.random.key(0)))
    assert out.routing.shape == (6, 7, MOE_CFG.num_layers, 2) and out.routing.dtype == np.uint8
    assert out.prompt_routing.shape == (6, 6, MOE_CFG.num_layers, 2)
    recorded, ran = _recorded(out), _ran(prompts, out, G)
    np.testing.assert_array_equal(recorded[~ran], 0)  # left padding and a row's last token: never run
    chosen, _ = _full_forward(graphdef, params, prompts, out, G)
    assert _same_sets(chosen, recorded)[ran].all()  # float32, margins far above rounding: the same experts
    _, replayed = _full_forward(graphdef, params, prompts, out, G, routing=jnp.asarray(recorded))
    drawn = out.completion_mask
    assert np.abs(replayed - out.logprobs)[drawn].max() <= 1e-5


def test_in_bfloat16_routing_differs_and_replay_shrinks_the_logprob_mismatch():
    graphdef, params = _model("bfloat16")
    prompts, G = _prompts(4), 4
    sampler = Sampler(graphdef, max_new_tokens=12, num_samples=G, method=METHOD)
    out = jax.device_get(sampler.generate(params, prompts, jax.random.key(0)))
    recorded, ran, drawn = _recorded(out), _ran(prompts, out, G), out.completion_mask
    chosen, free = _full_forward(graphdef, params, prompts, out, G)
    differing = int((~_same_sets(chosen, recorded) & ran[..., None]).sum())
    _, replayed = _full_forward(graphdef, params, prompts, out, G, routing=jnp.asarray(recorded))
    gap_free, gap_replayed = (float(np.abs(lp - out.logprobs)[drawn].mean()) for lp in (free, replayed))
    print(f"bfloat16: {differing} of {int(ran.sum()) * MOE_CFG.num_layers} top-k sets differ; mean |lp - lp_alpha| "
          f"{gap_free:.3g} free, {gap_replayed:.3g} replayed")
    assert differing > 0 and gap_replayed < gap_free


def test_appended_tokens_are_recorded_from_the_append_prefill():
    graphdef, params = _model()
    prompts = _prompts(2)
    sampler = Sampler(graphdef, max_new_tokens=16, num_samples=1, method=METHOD, turn_tokens=3, decode_chunk=2)
    state = sampler.start(params, prompts, jax.random.key(1))
    appended = {0: 0, 1: 0}
    for _ in range(50):
        state = sampler.advance(params, state)
        status = state.status()
        for slot in np.flatnonzero(status.state == PAUSED):
            row = int(status.row[slot])
            appended[row] += 1
            state = (sampler.append(params, state, slot, [7, 8, 9][:appended[row] + 1]) if appended[row] <= 2
                     else sampler.finish(state, slot))
        if state.idle():
            break
    rows, out, _ = sampler.drain(state)
    assert list(rows) == [0, 1] and min(appended.values()) >= 2
    recorded, ran = _recorded(out), _ran(prompts, out, 1)
    chosen, _ = _full_forward(graphdef, params, prompts, out, 1)
    assert (~np.asarray(out.loss_mask) & np.asarray(out.completion_mask)).sum() >= 4  # appended tokens in the rows
    assert _same_sets(chosen, recorded)[ran].all()


def test_the_record_is_right_aligned_to_the_trainers_prompt_width():
    # Rows sampled with prompts 3 wide, trained 5 wide (another batch widened the run's prompts) and 2 wide.
    prompt = np.arange(1, 4, dtype=np.int32).reshape(1, 3, 1, 1)  # [R=1, Ps=3, L=1, k=1]: experts 1, 2, 3
    completion = np.asarray([7, 8, 0], np.int32).reshape(1, 3, 1, 1)  # N = 3; the last token never fed
    wide = np.asarray(sequence_routing(prompt, completion, 5))[0, :, 0, 0]
    np.testing.assert_array_equal(wide, [0, 0, 1, 2, 3, 7, 8])  # P + N - 1 = 7 input positions
    narrow = np.asarray(sequence_routing(prompt, completion, 2))[0, :, 0, 0]
    np.testing.assert_array_equal(narrow, [2, 3, 7, 8])
    # Inputs [pad, p, p | c0, c1] of a row of length 2 (c1 its last: drawn, not fed) and one of length 3.
    mask = jnp.asarray([[False, True, True, True, True], [False, True, True, True, True]])
    ran = np.asarray(sampler_ran(mask, jnp.asarray([False, True]), 3))
    np.testing.assert_array_equal(ran, [[False, True, True, True, False], [False, True, True, True, True]])
