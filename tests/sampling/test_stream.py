"""A stream (`Sampler.open_stream / refill`, jgrpo.sampling.stream): batches fed into lanes of a pool that keeps
decoding, on the tiny Llama. Each batch draws what `generate` draws with its key; waiting rows start oldest batch
first; the pool counts the slot-steps that drew a token; a version change mid-row is recorded per token."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jgrpo.data.prompts import left_pad
from jgrpo.sampling.sampler import Prompts, Sampler, SamplingMethod
from jgrpo.sampling.stream import batch_rows
from tests.helpers_models import SAMPLER_PROMPTS

STOPS = tuple(range(2, 14))  # many stop ids: rows stop after a few tokens, at different steps
WIDTH = 12
G = 2


def _batch(j):
    """Batch j: two of the four sampler prompts, rotated by j, padded to WIDTH."""
    ids = [SAMPLER_PROMPTS[(2 * j) % 4], SAMPLER_PROMPTS[(2 * j + 1) % 4]]
    return Prompts(*left_pad(ids, pad_id=0, length=WIDTH))


def _key(j):
    return jax.random.fold_in(jax.random.key(3), j)


def _stream(sampler, params, batches: int, lanes: int, version_at=lambda chunk: 0):
    """Feed batches 0 .. batches-1 into a `lanes`-lane stream as lanes free up, a chunk at a time, the params'
    version `version_at(chunk)`. Returns ({batch: its rows in batch order (numpy SampleOutput)}, the state,
    [rows still waiting in older lanes whenever a lane was refilled], chunks)."""
    state = sampler.open_stream(params, lanes=lanes, batch=2, prompt_len=WIDTH)
    lane_of, next_batch, done, rows_of, waiting = {}, 0, {}, {}, []
    for chunk in range(500):
        for lane in range(lanes):
            busy = lane in lane_of.values()
            if not busy and next_batch < batches:
                waiting.append(int(np.asarray(state.pool.rows.queued).sum()))
                state = sampler.refill(params, state, lane, _batch(next_batch), _key(next_batch), next_batch)
                lane_of[next_batch], next_batch = lane, next_batch + 1
        state = sampler.advance(params, state, version=version_at(chunk))
        rows, out, state = sampler.drain(state)
        for i, r in enumerate(rows):
            rows_of[int(r)] = out.map(lambda x, i=i: np.asarray(x)[i])
        for j, lane in list(lane_of.items()):
            mine = batch_rows(state.spec, lane)
            if all(int(r) in rows_of for r in mine):
                parts = [rows_of.pop(int(r)) for r in mine]
                fields = [f for f in parts[0]._fields if getattr(parts[0], f) is not None]
                done[j] = parts[0].map(lambda _: None)._replace(
                    **{f: np.stack([getattr(p, f) for p in parts]) for f in fields})
                del lane_of[j]
        if len(done) == batches:
            return done, state, waiting, chunk + 1
    raise AssertionError("the stream did not finish")


@pytest.mark.parametrize("slots", [4, 3], ids=["a-batch", "fewer"])
def test_each_streamed_batch_draws_what_generate_draws_with_its_key(tiny_llama, slots):
    graphdef, params = tiny_llama
    sampler = Sampler(graphdef, max_new_tokens=10, num_samples=G, method=SamplingMethod(temperature=1.0),
                      stop_ids=STOPS, slots=slots, decode_chunk=3)
    done, state, _, _ = _stream(sampler, params, batches=5, lanes=2)
    lengths = []
    for j, got in done.items():
        whole = jax.device_get(sampler.replace(slots=None).generate(params, _batch(j), _key(j)))
        for field in ("tokens", "lengths", "completion_mask", "truncated", "loss_mask"):
            np.testing.assert_array_equal(getattr(got, field), getattr(whole, field), err_msg=f"batch {j} {field}")
        np.testing.assert_allclose(got.logprobs, whole.logprobs, atol=1e-5, rtol=0)
        lengths.append(got.lengths)
    lengths = np.concatenate(lengths)
    assert (lengths < 10).any() and (lengths == 10).any()  # rows stop at different steps
    # Every feed of a row draws one token; its first is drawn at admission: busy = sum of (length - 1).
    assert int(state.pool.busy) == int((lengths - 1).sum())
    assert int(state.pool.busy) <= int(state.pool.clock) * slots


def test_waiting_rows_start_oldest_batch_first(tiny_llama):
    graphdef, params = tiny_llama
    sampler = Sampler(graphdef, max_new_tokens=10, num_samples=G, method=SamplingMethod(temperature=1.0),
                      stop_ids=STOPS, slots=2, decode_chunk=2)
    # The version is the chunk number: a row's first token's version says when it started.
    done, _, waiting, _ = _stream(sampler, params, batches=4, lanes=2, version_at=lambda chunk: chunk)
    assert max(waiting[2:]) > 0  # a lane was refilled while an older batch's rows still waited: the order matters
    started = {j: out.version[:, 0] for j, out in done.items()}
    for j in range(3):
        assert started[j].max() <= started[j + 1].min(), (j, started)


def test_a_version_change_mid_row_is_recorded_per_token(tiny_llama):
    graphdef, params = tiny_llama
    sampler = Sampler(graphdef, max_new_tokens=24, num_samples=G, method=SamplingMethod(temperature=1.0),
                      slots=4, decode_chunk=4)
    done, _, _, chunks = _stream(sampler, params, batches=2, lanes=1, version_at=lambda chunk: 7 + chunk)
    out = done[0]
    assert (out.lengths == 24).all()  # no stop ids: every row runs its 24 tokens over several chunks
    # A chunk's steps each feed, then admit: the rows start in chunk 0's first step (its feed had no row) and
    # draw a token a step, so token t is drawn in chunk t // 4.
    expected = 7 + np.arange(24) // 4
    np.testing.assert_array_equal(out.version, np.broadcast_to(expected, out.version.shape))


def test_refilling_a_lane_that_is_not_free_is_refused(tiny_llama):
    graphdef, params = tiny_llama
    sampler = Sampler(graphdef, max_new_tokens=10, num_samples=G, stop_ids=STOPS, slots=2)
    state = sampler.open_stream(params, lanes=2, batch=2, prompt_len=WIDTH)
    state = sampler.refill(params, state, 0, _batch(0), _key(0), 0)
    with pytest.raises(ValueError, match="lane 0 still has rows"):
        sampler.refill(params, state, 0, _batch(1), _key(1), 1)
    with pytest.raises(ValueError, match="lane 2 is not one of the stream's 2"):
        sampler.refill(params, state, 2, _batch(1), _key(1), 1)


def test_one_batch_streamed_uses_the_slots_as_generate_would(tiny_llama):
    """`generate_utilization` replays generate's schedule from the lengths: a lane with one batch runs it, one step
    later (the chunk's first step admits the rows after a feed with none)."""
    from jgrpo.rollout.slot_metrics import generate_utilization

    graphdef, params = tiny_llama
    sampler = Sampler(graphdef, max_new_tokens=10, num_samples=G, method=SamplingMethod(temperature=1.0),
                      stop_ids=STOPS, slots=3, decode_chunk=3)
    done, state, _, _ = _stream(sampler, params, batches=1, lanes=1)
    busy, clock = int(state.pool.busy), int(state.pool.clock)
    assert busy / (3 * (clock - 1)) == pytest.approx(generate_utilization(done[0].lengths, 3))


def _logprobs_under(graphdef, params, prompt_tokens, prompt_mask, tokens, method):
    """Each token's log-prob [N] from one full forward over [its prompt | its tokens] with `params` (the trainer's
    view of that version)."""
    from jgrpo.models.llm import merge_model, position_ids_from_mask
    from jgrpo.rl.logprobs import token_logprobs

    seq = jnp.concatenate([prompt_tokens, tokens])[None]
    mask = jnp.concatenate([prompt_mask, jnp.ones_like(tokens, bool)])[None]
    model = merge_model(graphdef, params)
    hidden, _ = model(seq, position_ids_from_mask(mask), mask)
    P, N = prompt_tokens.shape[0], tokens.shape[0]
    lp, _ = token_logprobs(hidden[:, P - 1:P + N - 1], model.unembedding(), tokens[None], chunk=4,
                           process_logits=method.process_logits)
    return np.asarray(lp[0])


@pytest.mark.parametrize("kv", ["recompute", "keep"])
def test_recomputed_rows_draw_each_token_in_its_own_versions_context(tiny_llama, kv):
    """A weight update every chunk: with the keys/values recomputed at each update, every token's log-prob is its
    version's alone (the trainer's forward under that version matches it); kept, the tokens after an update were
    drawn in a context older versions computed, which no single version reproduces."""
    graphdef, params = tiny_llama
    method = SamplingMethod(temperature=1.0)
    versions = [jax.tree.map(lambda x, v=v: x * (1 + 0.1 * v) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                             params) for v in range(6)]
    sampler = Sampler(graphdef, max_new_tokens=20, num_samples=G, method=method, slots=4, decode_chunk=4)
    prompts = _batch(0)
    state = sampler.open_stream(params, lanes=1, batch=2, prompt_len=WIDTH)
    state = sampler.refill(versions[0], state, 0, prompts, _key(0), 0)
    for chunk in range(5):
        if chunk and kv == "recompute":
            state = sampler.recompute(versions[chunk], state, prompts)
        state = sampler.advance(versions[chunk], state, version=chunk)
    rows, out, state = sampler.drain(state)
    assert len(rows) == 4 and (out.lengths == 20).all()
    gaps = []
    for r in range(4):
        tokens, mask = jnp.asarray(prompts.tokens[r // G]), jnp.asarray(prompts.mask[r // G])
        for v in np.unique(out.version[r]):
            lp = _logprobs_under(graphdef, versions[v], tokens, mask, jnp.asarray(out.tokens[r]), method)
            mine = out.version[r] == v
            gaps.append(np.abs(lp[mine] - out.logprobs[r][mine]).max())
    if kv == "recompute":
        assert max(gaps) < 1e-4, gaps
    else:
        assert max(gaps) > 1e-3, gaps
