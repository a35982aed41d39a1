"""The sampler's slot-level interface (`Sampler.start / advance / append / finish / drain`, jgrpo.sampling.turns),
on the tiny Llama: driven by hand it draws what `generate` draws; an append equals prefilling the concatenated
prompt; params changed between two advances change only the later tokens, whose version is recorded."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jgrpo.models.llm import merge_model, position_ids_from_mask
from jgrpo.rl.logprobs import token_logprobs
from jgrpo.sampling.sampler import Prompts, Sampler, SamplingMethod
from jgrpo.sampling.turns import PAUSED
from tests.helpers_models import sampler_prompts

STOPS = tuple(range(2, 14))  # many stop ids: rows stop after a few tokens, at different steps
METHOD = SamplingMethod(temperature=1.0)


def _run_to_the_end(sampler, params, prompts, key, on_pause=None):
    """Advance a chunk at a time; each paused slot is handed to `on_pause(state, slot)` (default: finished).
    Returns the drained rows in row order as one SampleOutput (numpy)."""
    state = sampler.start(params, prompts, key)
    drained = {}
    for _ in range(200):
        state = sampler.advance(params, state)
        for slot in np.flatnonzero(state.status().state == PAUSED):
            state = on_pause(state, slot) if on_pause else sampler.finish(state, slot)
        rows, out, state = sampler.drain(state)
        drained.update({int(r): out.map(lambda x, i=i: np.asarray(x)[i]) for i, r in enumerate(rows)})
        if len(drained) == sampler.num_samples * prompts.tokens.shape[0]:
            break
    ordered = [drained[r] for r in sorted(drained)]
    fields = [f for f in ordered[0]._fields if getattr(ordered[0], f) is not None]
    return ordered[0].map(lambda _: None)._replace(**{f: np.stack([getattr(o, f) for o in ordered]) for f in fields})


@pytest.mark.parametrize("slots", [None, 3], ids=["static", "continuous"])
def test_driving_the_slots_by_hand_draws_what_generate_draws(tiny_llama, slots):
    graphdef, params = tiny_llama
    prompts = Prompts(*sampler_prompts())
    sampler = Sampler(graphdef, max_new_tokens=10, num_samples=2, method=METHOD, stop_ids=STOPS, slots=slots,
                      decode_chunk=3)
    whole = jax.device_get(sampler.generate(params, prompts, jax.random.key(5)))
    by_hand = _run_to_the_end(sampler, params, prompts, jax.random.key(5))
    assert (whole.lengths < 10).any() and (whole.lengths == 10).any()  # rows stop at different steps
    for field in ("tokens", "lengths", "completion_mask", "truncated", "loss_mask", "version"):
        np.testing.assert_array_equal(getattr(by_hand, field), getattr(whole, field), err_msg=field)
    # Rows that wait in a held slot start later in the ring than in generate's own refills: the same draws, the
    # log-probs summed in another order.
    np.testing.assert_allclose(by_hand.logprobs, whole.logprobs, atol=1e-5, rtol=0)


def _trainer_logprobs(graphdef, params, prompt_tokens, prompt_mask, row, method):
    """Log-probs of a row's tokens [N] from one full forward over [its prompt | its tokens], as the trainer sees."""
    tokens = jnp.concatenate([prompt_tokens, row.tokens])[None]
    mask = jnp.concatenate([prompt_mask, row.completion_mask])[None]
    model = merge_model(graphdef, params)
    hidden, _ = model(tokens, position_ids_from_mask(mask), mask)
    P, N = prompt_tokens.shape[0], row.tokens.shape[0]
    lp, _ = token_logprobs(hidden[:, P - 1:P + N - 1], model.unembedding(), jnp.asarray(row.tokens)[None], chunk=4,
                           process_logits=method.process_logits)
    return np.asarray(lp[0])


def test_an_append_continues_the_row_as_if_its_context_were_the_prompt(tiny_llama):
    graphdef, params = tiny_llama
    tokens, mask = sampler_prompts()
    prompts = Prompts(tokens[:2], mask[:2])
    sampler = Sampler(graphdef, max_new_tokens=24, num_samples=1, method=METHOD, turn_tokens=4, decode_chunk=2)
    replies = {0: [[7, 8, 9], [11]], 1: [[40, 41], [50, 51, 52]]}  # the environment's tokens after turns 1, 2
    turns = {}

    def reply(state, slot):
        status = state.status()
        row, end, length = int(status.row[slot]), int(status.length[slot]), int(status.turn_length[slot])
        # The paused turn as `turns()` cuts it out: the row's last `length` tokens.
        whole = np.asarray(state.pool.rows.tokens).reshape(-1, state.pool.rows.tokens.shape[-1])
        np.testing.assert_array_equal(state.turns()[slot, :length], whole[row, end - length:end])
        assert length == 4
        turns[row] = turns.get(row, 0) + 1
        if turns[row] <= 2:
            return sampler.append(params, state, slot, replies[row][turns[row] - 1])
        return sampler.finish(state, slot)

    out = _run_to_the_end(sampler, params, prompts, jax.random.key(2), on_pause=reply)
    for r, (first, second) in replies.items():
        row = jax.tree.map(lambda x, r=r: x[r], out)
        # Three turns of 4 drawn tokens (no stop ids) with the replies between them; the second append prefills
        # after the first one's context (the segment is built turn by turn).
        drawn = [True] * 4 + [False] * len(first) + [True] * 4 + [False] * len(second) + [True] * 4
        assert row.lengths == len(drawn)
        np.testing.assert_array_equal(row.loss_mask[:row.lengths], drawn)
        np.testing.assert_array_equal(row.tokens[4:4 + len(first)], first)
        np.testing.assert_array_equal(row.tokens[8 + len(first):8 + len(first) + len(second)], second)
        np.testing.assert_array_equal(row.version[:row.lengths], np.where(drawn, 0, -1))
        np.testing.assert_array_equal(row.logprobs[:row.lengths][~np.asarray(drawn)], 0.0)
        recomputed = _trainer_logprobs(graphdef, params, tokens[r], mask[r], row, METHOD)
        drawn = row.loss_mask
        np.testing.assert_allclose(row.logprobs[drawn], recomputed[drawn], atol=1e-5, rtol=0)


def test_params_changed_between_advances_change_only_later_tokens(tiny_llama):
    graphdef, params = tiny_llama
    prompts = Prompts(*sampler_prompts())
    sampler = Sampler(graphdef, max_new_tokens=12, num_samples=2, method=METHOD, decode_chunk=3)
    other = jax.tree.map(lambda x: x * 1.5, params)  # a weight update that changes the draws

    def sample(switch_after: int | None):
        state = sampler.start(params, prompts, jax.random.key(9))
        for chunk in range(6):
            new = switch_after is not None and chunk >= switch_after
            state = sampler.advance(other if new else params, state, version=1 if new else 0)
        return jax.device_get(sampler.drain(state)[1])

    same, switched = sample(None), sample(1)
    before = switched.version == 0
    assert before.any() and (switched.version == 1).any()
    np.testing.assert_array_equal(switched.tokens[before], same.tokens[before])  # drawn before the change
    assert (switched.tokens[~before] != same.tokens[~before]).any()  # and the new weights drew the rest
    assert (same.version[same.loss_mask] == 0).all()
    # Versions never go back: within a row, the version is 0 up to the change, then 1.
    assert (np.diff(np.where(switched.loss_mask, switched.version, 1), axis=1) >= 0).all()


def test_appends_of_any_length_run_one_program_and_bad_appends_are_named(tiny_llama, compile_counter):
    graphdef, params = tiny_llama
    tokens, mask = sampler_prompts()
    sampler = Sampler(graphdef, max_new_tokens=16, method=METHOD, turn_tokens=3, decode_chunk=2)
    state = sampler.advance(params, sampler.start(params, Prompts(tokens, mask), jax.random.key(0)), chunks=4)
    paused = np.flatnonzero(state.status().state == PAUSED)
    assert len(paused) == 4  # every row used its 3 tokens
    state = sampler.append(params, state, paused[0], [5, 6])  # compiles the append program once
    compile_counter.count, compile_counter.active = 0, True
    state = sampler.append(params, state, paused[1], [5, 6, 7, 8, 9])
    state = sampler.append(params, state, paused[2], [1])
    compile_counter.active = False
    assert compile_counter.count == 0
    with pytest.raises(ValueError, match="tokens are appended to a paused row only"):
        sampler.append(params, state, paused[0], [1])
    with pytest.raises(ValueError, match=r"13 more and a turn do not fit \(at most 12\)"):
        sampler.append(params, state, paused[3], list(range(13)))


@pytest.mark.parametrize(("parked", "kv_cache_dtype"), [(False, "auto"), (True, "auto"), (True, "int8")],
                         ids=["kept_slot", "parked", "parked_int8_cache"])
def test_a_row_that_waits_while_others_decode_keeps_its_turn(tiny_llama, parked, kv_cache_dtype):
    # Row 1's turns wait (paused, or parked and resumed later) while row 0 decodes on for several ring laps: the
    # keys/values of its turn, fed into the decode ring, must survive until the append moves them after its
    # context. Its log-probs then equal the trainer's forward over the whole row; with an int8 cache (its values
    # and scales moved alike) they are the quantized policy's, close to it.
    graphdef, params = tiny_llama
    tokens, mask = sampler_prompts()
    prompts = Prompts(tokens[:2], mask[:2])
    sampler = Sampler(graphdef, max_new_tokens=24, num_samples=1, method=METHOD, turn_tokens=4, decode_chunk=2,
                      kv_cache_dtype=kv_cache_dtype)
    state = sampler.start(params, prompts, jax.random.key(3))
    turns, waiting = {0: 0, 1: 0}, []
    for _ in range(100):
        status = state.status()
        for slot in np.flatnonzero(status.state == PAUSED):
            row = int(status.row[slot])
            if (row, slot) in waiting:
                continue
            turns[row] += 1
            if turns[row] == 3:
                state = sampler.finish(state, slot)
            elif row == 0:
                state = sampler.append(params, state, slot, [7, 8])
            elif parked:
                state, _ = sampler.park(state, slot)
                waiting.append((row, slot))
            else:
                waiting.append((row, slot))
        if waiting and (turns[0] == 3 or state.idle()):  # row 0 is done (or waits itself): row 1 goes on
            row, slot = waiting.pop()
            state = (sampler.resume(params, state, slot, row, [9]) if parked else
                     sampler.append(params, state, slot, [9]))
        if turns[1] == 3:
            break
        state = sampler.advance(params, state)
    rows, out, _ = sampler.drain(state)
    assert list(rows) == [0, 1] and turns == {0: 3, 1: 3}
    for r in (0, 1):
        row = jax.tree.map(lambda x, r=r: np.asarray(x)[r], out)
        recomputed = _trainer_logprobs(graphdef, params, tokens[r], mask[r], row, METHOD)
        drawn = row.loss_mask
        assert drawn.sum() == 12
        error = np.abs(row.logprobs[drawn] - recomputed[drawn])
        if kv_cache_dtype == "int8":  # one-shot sampling with an int8 cache on this model: mean 0.016, max 0.13
            assert 1e-4 < error.mean() < 0.05 and error.max() < 0.25
        else:
            np.testing.assert_allclose(row.logprobs[drawn], recomputed[drawn], atol=1e-5, rtol=0)
