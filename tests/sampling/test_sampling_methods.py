"""Sampling methods: hand-derived distributions, parity with transformers' warpers, chi-square tests."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from scipy import stats
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from jgrpo.config import SamplerConfig
from jgrpo.sampling.methods import SamplingMethod

PROBS = np.array([0.5, 0.3, 0.15, 0.05])
LOGITS = jnp.log(jnp.asarray(PROBS, jnp.float32))


def probs_of(method, logits=LOGITS):
    return np.exp(np.asarray(method.process_logits(logits), np.float64))


# Hand-derived from the definitions, on p = [.5, .3, .15, .05]:
#  top_p .7: mass before each token is 0, .5, .8, .95 -> keep the first two, renormalise by .8.
#  top_k 3 / min_p .25 (cut at .25 * .5 = .125): drop .05, renormalise by .95.
#  temperature 2: p ** (1/2) renormalised; with top_k 3 and top_p .7 on top: the T=2 top-3 probs are
#  .4306, .3335, .2359 (mass before: 0, .4306, .7641) -> keep two: sqrt(.5), sqrt(.3) renormalised.
SQ = np.sqrt(PROBS)
HAND_DERIVED = [
    (SamplingMethod(), PROBS),
    (SamplingMethod(top_p=0.7), [0.5 / 0.8, 0.3 / 0.8, 0, 0]),
    (SamplingMethod(top_k=3), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]),
    (SamplingMethod(min_p=0.25), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]),
    (SamplingMethod(min_p=0.61), [1, 0, 0, 0]),  # cut at .305: only .5 survives
    (SamplingMethod(temperature=2.0), SQ / SQ.sum()),
    (SamplingMethod(temperature=2.0, top_k=3, top_p=0.7), [SQ[0] / SQ[:2].sum(), SQ[1] / SQ[:2].sum(), 0, 0]),
    (SamplingMethod(temperature=0), [1, 0, 0, 0]),
    (SamplingMethod(top_k=4), PROBS),  # k >= vocab is off
]


SEARCHES = ["sort", "bisect"]


@pytest.mark.parametrize("search", SEARCHES)
@pytest.mark.parametrize("method,expected", HAND_DERIVED, ids=str)
def test_process_logits_hand_derived(method, expected, search):
    logprobs = dataclasses.replace(method, threshold_search=search).process_logits(LOGITS)
    assert logprobs.dtype == jnp.float32
    np.testing.assert_allclose(np.exp(np.asarray(logprobs)), expected, rtol=1e-6, atol=1e-7)
    outside = np.asarray(expected) == 0
    assert np.all(np.isneginf(np.asarray(logprobs)[outside]))  # -inf, not a tiny number, outside the support


@pytest.mark.parametrize("search", SEARCHES)
def test_ties_at_a_threshold_are_kept(search):
    logits = jnp.array([1.0, 1.0, 1.0, 0.0])
    top_k = SamplingMethod(top_k=2, threshold_search=search)
    np.testing.assert_allclose(probs_of(top_k, logits), [1 / 3, 1 / 3, 1 / 3, 0], rtol=1e-6)
    # Top-p renormalises over all the top-k kept, ties included: on [2, 1, 1, 1] p = e^2 / (e^2 + 3e) = .4754
    # and .1749 each, so the mass before the second token is .4754 < .6 and the nucleus keeps the tied 1s.
    # (Over the k = 2 ranked logits alone the first token would hold .7311 and the nucleus would stop there.)
    both = SamplingMethod(top_k=2, top_p=0.6, threshold_search=search)
    e, e2 = np.e, np.e ** 2
    np.testing.assert_allclose(probs_of(both, jnp.array([2.0, 1.0, 1.0, 1.0, 0.0, -1.0])),
                               [e2 / (e2 + 3 * e), *[e / (e2 + 3 * e)] * 3, 0, 0], rtol=1e-6)
    # Greedy breaks ties towards the lowest id, in both process_logits and next_tokens.
    greedy = SamplingMethod(temperature=0)
    np.testing.assert_array_equal(probs_of(greedy, logits), [1, 0, 0, 0])
    assert int(greedy.next_tokens(logits, jax.random.key(0))) == 0


def _hf_reference(method, logits):
    """The same method built from transformers' own logits warpers (the order generate() uses)."""
    scores = torch.tensor(np.asarray(logits), dtype=torch.float64)
    warpers = []
    if method.temperature != 1:
        warpers.append(TemperatureLogitsWarper(method.temperature))
    if method.top_k:
        warpers.append(TopKLogitsWarper(method.top_k))
    if method.top_p < 1:
        warpers.append(TopPLogitsWarper(method.top_p))
    if method.min_p > 0:
        warpers.append(MinPLogitsWarper(method.min_p))
    for warp in warpers:
        scores = warp(None, scores)
    return torch.log_softmax(scores, dim=-1).numpy()


@pytest.mark.parametrize(
    "method",
    [
        SamplingMethod(temperature=0.7),
        SamplingMethod(top_k=5),
        SamplingMethod(top_p=0.8),
        SamplingMethod(min_p=0.05),
        SamplingMethod(temperature=1.3, top_k=20, top_p=0.9, min_p=0.02),
        SamplingMethod(temperature=0.6, top_p=0.95),
    ],
    ids=str,
)
@pytest.mark.parametrize("search", SEARCHES)
def test_matches_transformers_warpers(method, search):
    logits = jax.random.normal(jax.random.key(3), (6, 64)) * 3  # [rows, V]
    ours = np.asarray(dataclasses.replace(method, threshold_search=search).process_logits(logits))
    theirs = _hf_reference(method, logits)
    np.testing.assert_array_equal(np.isneginf(ours), np.isneginf(theirs))  # identical supports
    kept = ~np.isneginf(theirs)
    np.testing.assert_allclose(ours[kept], theirs[kept], atol=2e-6)


def test_process_logits_is_jittable_and_batched():
    method = SamplingMethod(temperature=0.8, top_k=3, top_p=0.9)
    logits = jax.random.normal(jax.random.key(0), (2, 3, 16))  # any leading shape
    eager = method.process_logits(logits)
    jitted = jax.jit(method.process_logits)(logits)
    static = jax.jit(lambda m, x: m.process_logits(x), static_argnums=0)(method, logits)  # hashable static arg
    np.testing.assert_allclose(jitted, eager, rtol=1e-6)
    np.testing.assert_allclose(static, eager, rtol=1e-6)
    np.testing.assert_allclose(jax.nn.logsumexp(eager, axis=-1), 0.0, atol=1e-6)  # normalised


# Chi-square: 20000 draws from a 6-token vocabulary against the truncated, renormalised softmax.
CHI_LOGITS = jnp.asarray([2.0, 1.5, 1.0, 0.2, -0.5, -1.0], jnp.float32)
DRAWS = 20_000


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def _expected(temperature=1.0, keep=6):
    """Reference distribution written straight from the definitions (the logits are already sorted)."""
    p = _softmax(np.asarray(CHI_LOGITS, np.float64) / temperature)
    p[keep:] = 0
    return p / p.sum()


# keep counts from the definitions: T=1 probs are .434 .263 .160 .072 .036 .022 (cum .434 .697 .857 .929 ...).
CHI_CASES = [
    (SamplingMethod(temperature=1.0), _expected(1.0)),
    (SamplingMethod(temperature=0.5), _expected(0.5)),
    (SamplingMethod(temperature=2.0), _expected(2.0)),
    (SamplingMethod(top_k=3), _expected(1.0, keep=3)),
    (SamplingMethod(top_p=0.8), _expected(1.0, keep=3)),  # mass before the 4th is .857 >= .8
    (SamplingMethod(min_p=0.1), _expected(1.0, keep=4)),  # cut at .0434: .072 stays, .036 goes
    (SamplingMethod(temperature=2.0, top_k=4, top_p=0.75), _expected(2.0, keep=3)),
]


def _draw_counts(method, per_row_keys):
    key = jax.random.key(1234)
    logits = jnp.broadcast_to(CHI_LOGITS, (DRAWS, CHI_LOGITS.size))
    keys = jax.random.split(key, DRAWS) if per_row_keys else key
    tokens = np.asarray(jax.jit(method.next_tokens)(logits, keys))
    return np.bincount(tokens, minlength=CHI_LOGITS.size)


@pytest.mark.parametrize("draw", ["inverse_cdf", "gumbel", "categorical"])
@pytest.mark.parametrize("per_row_keys", [True, False], ids=["row-keys", "one-key"])
@pytest.mark.parametrize("method,expected", CHI_CASES, ids=str)
def test_sample_frequencies_chi_square(method, expected, per_row_keys, draw):
    counts = _draw_counts(dataclasses.replace(method, draw=draw), per_row_keys)
    support = expected > 0
    assert counts[~support].sum() == 0, f"tokens outside the support were drawn: {counts}"
    result = stats.chisquare(counts[support], DRAWS * expected[support])
    assert result.pvalue > 1e-3, f"counts {counts} vs expected {DRAWS * expected}: p={result.pvalue:.2e}"
    # The test has teeth: the same counts are rejected against the untruncated, untempered softmax.
    naive = _expected(1.0)
    if not np.allclose(naive, expected):
        assert stats.chisquare(counts, DRAWS * naive).pvalue < 1e-6


@pytest.mark.parametrize("draw", ["inverse_cdf", "gumbel", "categorical"])
def test_multi_block_vocab_chi_square(draw):
    """Vocab of 1000 (several 256-token blocks, a ragged last one): mass on block edges and the last ids."""
    support = np.array([3, 255, 256, 257, 511, 600, 998, 999])
    weights = np.array([0.05, 0.2, 0.1, 0.15, 0.05, 0.25, 0.1, 0.1])
    logits = np.full(1000, -np.inf, np.float32)
    logits[support] = np.log(weights)
    keys = jax.random.split(jax.random.key(9), DRAWS)
    method = SamplingMethod(draw=draw)
    tokens = np.asarray(jax.jit(method.next_tokens)(jnp.broadcast_to(logits, (DRAWS, 1000)), keys))
    assert np.isin(tokens, support).all()
    counts = np.array([(tokens == t).sum() for t in support])
    assert stats.chisquare(counts, DRAWS * weights).pvalue > 1e-3


def test_wide_distribution_chi_square():
    logits = jax.random.normal(jax.random.key(4), (700,)) * 0.3  # every one of 700 ids has mass
    expected = _softmax(np.asarray(logits, np.float64))
    tokens = np.asarray(SamplingMethod().next_tokens(jnp.broadcast_to(logits, (50_000, 700)), jax.random.key(6)))
    counts = np.bincount(tokens, minlength=700)
    assert stats.chisquare(counts, 50_000 * expected).pvalue > 1e-3


def test_greedy_next_tokens_are_argmax():
    logits = jax.random.normal(jax.random.key(7), (5, 32))
    tokens = SamplingMethod(temperature=0).next_tokens(logits, jax.random.key(0))
    np.testing.assert_array_equal(tokens, np.argmax(np.asarray(logits), axis=-1))
    assert tokens.dtype == jnp.int32


def test_choose_returns_the_logprob_of_the_chosen_token():
    method = SamplingMethod(temperature=0.7, top_k=4)
    logprobs = method.process_logits(jax.random.normal(jax.random.key(2), (8, 16)))
    tokens, chosen = method.choose(logprobs, jax.random.split(jax.random.key(5), 8))
    np.testing.assert_array_equal(chosen, np.asarray(logprobs)[np.arange(8), np.asarray(tokens)])
    assert np.all(np.isfinite(chosen))


@pytest.mark.parametrize("draw", ["inverse_cdf", "gumbel"])
def test_mismatched_row_keys_are_an_error(draw):
    with pytest.raises(ValueError, match="do not match the rows"):
        SamplingMethod(draw=draw).next_tokens(jnp.zeros((4, 8)), jax.random.split(jax.random.key(0), 3))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": 1.0}, "min_p"),
    ],
)
def test_bad_settings_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingMethod(**kwargs)


@pytest.mark.parametrize("method", [SamplingMethod(top_k=1), SamplingMethod(top_k=50), SamplingMethod(top_p=0.9),
                                    SamplingMethod(top_p=1e-6), SamplingMethod(temperature=0.7, top_k=7, top_p=0.95),
                                    SamplingMethod(top_k=20, top_p=0.7, min_p=0.01)], ids=str)
def test_bisected_thresholds_are_the_sorted_ones(method):
    # Rows with ties (rounded logits), with -inf entries (a masked vocabulary) and one all-equal row; both
    # searches must keep exactly the same tokens with the same log-probs.
    logits = np.array(jax.random.normal(jax.random.key(5), (24, 300)) * 3)
    logits[:8] = np.round(logits[:8])
    logits[8:16, :150] = -np.inf
    logits[16] = 0.0
    by_sort = np.asarray(dataclasses.replace(method, threshold_search="sort").process_logits(jnp.asarray(logits)))
    by_bisection = np.asarray(jax.jit(dataclasses.replace(method, threshold_search="bisect").process_logits)(logits))
    np.testing.assert_array_equal(np.isneginf(by_bisection), np.isneginf(by_sort))
    kept = ~np.isneginf(by_sort)
    np.testing.assert_allclose(by_bisection[kept], by_sort[kept], atol=1e-6, rtol=0)


def test_from_config():
    config = SamplerConfig(temperature=0.7, top_k=50, top_p=0.9, min_p=0.05)
    assert SamplingMethod.from_config(config, "cpu") == SamplingMethod(temperature=0.7, top_k=50, top_p=0.9,
                                                                       min_p=0.05, draw="inverse_cdf",
                                                                       threshold_search="bisect")
    assert SamplingMethod.from_config(dataclasses.replace(config, draw="gumbel"), "tpu").draw == "gumbel"
    assert SamplingMethod.from_config(config, "cpu").threshold_search == "bisect"  # auto: by platform
    assert SamplingMethod.from_config(config, "tpu").threshold_search == "sort"
    assert SamplingMethod.from_config(dataclasses.replace(config, threshold_search="bisect"), "gpu") \
        .threshold_search == "bisect"
    with pytest.raises(ValueError, match="threshold_search"):
        SamplingMethod(threshold_search="heap")
    with pytest.raises(ValueError, match="draw"):
        SamplingMethod(draw="alias")
