"""Continuous batching (`generate(..., slots=S)`, jgrpo.sampling.decode_loop): S slots taking the next row as rows
stop give every row exactly the tokens static batching gives it, whatever its slot, with the same log-probs."""

import jax
import numpy as np
import pytest

from jgrpo.config import MeshConfig
from jgrpo.parallel.mesh import make_mesh
from jgrpo.sampling.sampler import SamplingMethod
from tests.helpers import generate
from tests.helpers_models import SAMPLER_PROMPTS, sampler_prompts

# Many stop ids: most rows stop after a few tokens, some run to the end, so slots free up at different steps.
STOPS = tuple(range(2, 14))


def _assert_same(static, continuous, rtol=1e-6):
    """Same tokens; log-probs within 1e-6 relative: a few float32 ulps, since the matmuls see another batch size."""
    np.testing.assert_array_equal(static.tokens, continuous.tokens)
    np.testing.assert_array_equal(static.lengths, continuous.lengths)
    np.testing.assert_array_equal(static.truncated, continuous.truncated)
    np.testing.assert_array_equal(static.completion_mask, continuous.completion_mask)
    np.testing.assert_allclose(static.logprobs, continuous.logprobs, rtol=rtol, atol=1e-7)


def test_continuous_equals_static_token_for_token(tiny_llama):
    graphdef, params = tiny_llama
    tokens, mask = sampler_prompts()
    kwargs = dict(num_samples=3, max_new_tokens=12, method=SamplingMethod(temperature=1.3), stop_ids=STOPS,
                  key=jax.random.key(4), page_size=4)  # rows over several pages, taken and given back
    static = generate(graphdef, params, tokens, mask, **kwargs)
    lengths = np.asarray(static.lengths)
    assert lengths.min() < 4 and lengths.max() == 12 and len(set(lengths.tolist())) >= 4, lengths  # a real spread
    for slots in (1, 5):  # one slot (every row after another) and a pool that refills at different steps
        _assert_same(static, generate(graphdef, params, tokens, mask, slots=slots, **kwargs))


def test_continuous_sharded_over_queues_equals_static(tiny_llama):
    """On the 8-device mesh the rows split into 4 queues (data x fsdp), 2 slots each; same tokens as one device."""
    graphdef, params = tiny_llama
    tokens, mask = sampler_prompts()
    kwargs = dict(num_samples=4, max_new_tokens=10, method=SamplingMethod(temperature=1.2, top_p=0.95),
                  stop_ids=STOPS, key=jax.random.key(9))
    static = generate(graphdef, params, tokens, mask, **kwargs)
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    sharded = generate(graphdef, params, tokens, mask, mesh=mesh, slots=8, **kwargs)
    assert sharded.tokens.sharding.spec[0] == ("data", "fsdp")
    _assert_same(static, sharded, rtol=1e-5)  # tensor-parallel matmuls round differently from one device


def test_continuous_with_scanned_layers_equals_static(tiny_llama):
    graphdef, params = tiny_llama
    tokens, mask = sampler_prompts()
    kwargs = dict(num_samples=2, max_new_tokens=9, method=SamplingMethod(temperature=1.0), stop_ids=STOPS,
                  key=jax.random.key(1), decode_layers="scanned", page_size=3)
    _assert_same(generate(graphdef, params, tokens, mask, **kwargs),
                 generate(graphdef, params, tokens, mask, slots=3, **kwargs))


def test_rows_that_stop_at_once_and_single_token_rows(tiny_llama):
    """A row whose first token is a stop frees its slot at once; N = 1 rows never feed a token."""
    graphdef, params = tiny_llama
    tokens, mask = sampler_prompts()
    greedy = SamplingMethod(temperature=0)
    first = np.asarray(generate(graphdef, params, tokens, mask, num_samples=1, max_new_tokens=1, method=greedy,
                                stop_ids=(), key=jax.random.key(0)).tokens[:, 0])
    kwargs = dict(num_samples=2, max_new_tokens=6, method=greedy, stop_ids=(int(first[1]),), key=jax.random.key(0))
    static = generate(graphdef, params, tokens, mask, **kwargs)
    assert (np.asarray(static.lengths)[2:4] == 1).all()  # prompt 1's rows stop on their first token
    _assert_same(static, generate(graphdef, params, tokens, mask, slots=2, **kwargs))
    one = dict(kwargs, max_new_tokens=1)
    _assert_same(generate(graphdef, params, tokens, mask, **one), generate(graphdef, params, tokens, mask, slots=3,
                                                                             **one))


def test_every_row_at_full_length_fits_the_bounded_laps(tiny_llama):
    """The worst case the decode loop is bounded for: no stop ids, every row runs to N, in ceil(R/S) waves
    (N - 1 = 8 fed tokens: two whole pages of 4 per row)."""
    graphdef, params = tiny_llama
    tokens, mask = sampler_prompts()
    kwargs = dict(num_samples=2, max_new_tokens=9, method=SamplingMethod(temperature=1.0), stop_ids=(),
                  key=jax.random.key(3), page_size=4)
    static = generate(graphdef, params, tokens, mask, **kwargs)
    assert (np.asarray(static.lengths) == 9).all()
    for slots in (1, 3):  # 8 waves of one row; 3 waves of 3, 3 and 2 rows
        # Same tokens; log-probs within 1e-5 (one slot runs each row's matmuls alone: measured 2e-6 relative)
        _assert_same(static, generate(graphdef, params, tokens, mask, slots=slots, **kwargs), rtol=1e-5)


def test_bad_slot_count_is_named(tiny_llama):
    graphdef, params = tiny_llama
    with pytest.raises(ValueError, match="slots=0"):
        generate(graphdef, params, *sampler_prompts(), num_samples=1, max_new_tokens=4, method=SamplingMethod(),
                 stop_ids=(), key=jax.random.key(0), slots=0)
    assert len(SAMPLER_PROMPTS) == 4


def test_batches_sampled_together_get_their_own_tokens(tiny_llama):
    """Per-prompt keys and indices: two batches in one slot pool == each batch sampled alone with its own key."""
    graphdef, params = tiny_llama
    tokens, mask = sampler_prompts()
    kwargs = dict(num_samples=2, max_new_tokens=8, method=SamplingMethod(temperature=1.1), stop_ids=STOPS)
    first, second = jax.random.key(21), jax.random.key(22)
    alone = [generate(graphdef, params, tokens[:2], mask[:2], key=first, **kwargs),
             generate(graphdef, params, tokens[2:], mask[2:], key=second, **kwargs)]
    together = generate(graphdef, params, tokens, mask, key=jax.numpy.stack([first, first, second, second]),
                        prompt_index=np.array([0, 1, 0, 1]), slots=3, **kwargs)
    for i, part in enumerate(alone):
        rows = slice(4 * i, 4 * i + 4)
        np.testing.assert_array_equal(part.tokens, together.tokens[rows])
        np.testing.assert_array_equal(part.lengths, together.lengths[rows])
        np.testing.assert_allclose(part.logprobs, together.logprobs[rows], rtol=1e-5, atol=1e-6)
