"""How the next token is drawn from the model's logits: greedy, temperature, top-k, top-p, min-p.

One small frozen dataclass holds every knob, so the methods combine freely and the method is a
hashable static argument of the jitted decode loop. `process_logits` turns raw logits into the
float32 log-probs of the distribution *actually sampled from*; the sampler records those
log-probs and the trainer recomputes them with the same function (docs/algorithm.md §6), so the two can
only agree if both call this one pure function.

Order of the transformations (the same as transformers' `generate`): temperature, then top-k,
then top-p on the top-k-renormalised distribution, then min-p. Every truncation keeps the tokens
whose logit is at least some threshold, so the support is always "the m largest logits" and the
result is computed as one threshold and one mask. Ties at a threshold are all kept.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jgrpo.parallel.platform_defaults import resolve

DRAWS = ("inverse_cdf", "gumbel", "categorical")
# What `sampler.draw: auto` picks by platform (reasons: docs/configuration.md).
DRAW_AUTO = {"cpu": "inverse_cdf", "tpu": "categorical", "gpu": "categorical", "other": "inverse_cdf"}
THRESHOLD_SEARCHES = ("sort", "bisect")
# What `sampler.threshold_search: auto` picks (XLA:CPU sorts the whole row even for lax.top_k(x, 3)).
THRESHOLD_SEARCH_AUTO = {"cpu": "bisect", "tpu": "sort", "gpu": "sort", "other": "sort"}


def resolve_draw(choice: str, platform: str) -> str:
    """`sampler.draw` ("auto" or one of DRAWS) on devices of `platform`."""
    return resolve("sampler.draw", choice, DRAWS, DRAW_AUTO, platform)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingMethod:
    """Temperature 0 is greedy (argmax, ties to the lowest id); top_k 0, top_p 1 and min_p 0 are off.

    `draw` is how one token is drawn from the processed distribution: the same distribution whichever it is
    (tested), a different cost per backend: `inverse_cdf` (one uniform per row, a two-level CDF walk),
    `gumbel` (argmax of log-probs plus V Gumbel numbers per row) or `categorical` (jax.random.categorical).
    `threshold_search` is how the top-k and top-p thresholds are found: `sort` (lax.top_k, then a cumulative
    sum of the ranked probabilities) or `bisect` (32 halvings of the float's ordered bit pattern, each one
    count or masked sum over the row): the same threshold up to the order of a float sum (tested).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    draw: str = "inverse_cdf"
    threshold_search: str = "sort"

    def __post_init__(self):
        if not (isinstance(self.temperature, int | float) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise ValueError(f"temperature={self.temperature!r}: must be a finite number >= 0 (0 = greedy)")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"top_k={self.top_k!r}: must be an integer >= 0 (0 = off)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r}: must be in (0, 1] (1 = off)")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p={self.min_p!r}: must be in [0, 1) (0 = off)")
        if self.draw not in DRAWS:
            raise ValueError(f"draw={self.draw!r}: must be one of {DRAWS}")
        if self.threshold_search not in THRESHOLD_SEARCHES:
            raise ValueError(f"threshold_search={self.threshold_search!r}: must be one of {THRESHOLD_SEARCHES}")

    @classmethod
    def from_config(cls, config, platform: str) -> SamplingMethod:
        """From a `jgrpo.config.SamplerConfig`, its "auto" switches resolved for devices of `platform`."""
        search = resolve("sampler.threshold_search", config.threshold_search, THRESHOLD_SEARCHES,
                         THRESHOLD_SEARCH_AUTO, platform)
        return cls(temperature=config.temperature, top_k=config.top_k, top_p=config.top_p, min_p=config.min_p,
                   draw=resolve_draw(config.draw, platform), threshold_search=search)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def truncates(self) -> bool:
        """Whether the sampled distribution is a truncation (top-k, top-p or min-p) of the tempered softmax."""
        return 0 < self.top_k or self.top_p < 1 or self.min_p > 0

    def tempered_logprobs(self, logits: jax.Array) -> jax.Array:
        """[..., V] logits -> float32 log_softmax(logits / T), untruncated: finite for every token.

        The KL to the reference compares these (for both policies), not the truncated ones: a token outside one
        policy's truncated support would make it infinite, and at equal params it is exactly 0 either way.
        """
        if self.is_greedy:
            raise ValueError("greedy decoding has no tempered distribution (temperature 0)")
        logits = jnp.asarray(logits, jnp.float32)
        scaled = logits if self.temperature == 1 else logits / jnp.float32(self.temperature)
        return jax.nn.log_softmax(scaled, axis=-1)

    def process_logits(self, logits: jax.Array) -> jax.Array:
        """[..., V] logits -> [..., V] float32 log-probs of the sampled distribution (-inf outside its support)."""
        logits = jnp.asarray(logits, jnp.float32)
        vocab = logits.shape[-1]
        if self.is_greedy:
            best = _argmax(logits)[..., None]  # [..., 1]
            is_best = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1) == best
            return jnp.where(is_best, 0.0, -jnp.inf)
        scaled = logits if self.temperature == 1 else logits / jnp.float32(self.temperature)
        threshold = jnp.full(logits.shape[:-1], -jnp.inf, jnp.float32)  # [...]
        top_k = self.top_k if 0 < self.top_k < vocab else 0
        if (top_k or self.top_p < 1) and self.threshold_search == "bisect":
            threshold = _bisected_threshold(scaled, top_k, self.top_p)
        elif top_k or self.top_p < 1:
            # Descending logits: only the top k when top-k is on, the whole vocab for plain top-p.
            ranked = jax.lax.top_k(scaled, top_k or vocab)[0]  # [..., K]
            if top_k:
                threshold = ranked[..., -1]
            if self.top_p < 1:
                # Renormalised over every token the top-k kept: ties at the k-th beyond the k ranked ones too.
                log_norm = None
                if top_k:
                    kept = jnp.where(scaled >= threshold[..., None], scaled, -jnp.inf)
                    log_norm = jax.nn.logsumexp(kept, axis=-1, keepdims=True)
                threshold = jnp.maximum(threshold, _nucleus_threshold(ranked, self.top_p, log_norm))
        if self.min_p > 0:
            # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p); renormalising changes neither side.
            threshold = jnp.maximum(threshold, jnp.max(scaled, axis=-1) + jnp.float32(math.log(self.min_p)))
        if top_k or self.top_p < 1 or self.min_p > 0:
            scaled = jnp.where(scaled >= threshold[..., None], scaled, -jnp.inf)
        return jax.nn.log_softmax(scaled, axis=-1)

    def next_tokens(self, logits: jax.Array, key: jax.Array) -> jax.Array:
        """[..., V] logits -> [...] int32 token ids. `key` is one key, or one key per row (shape logits[:-1])."""
        return self.choose(self.process_logits(logits), key)[0]

    def choose(self, logprobs: jax.Array, key: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Draw from already processed log-probs: ([...] int32 tokens, [...] float32 their log-probs)."""
        if self.is_greedy:
            tokens = _argmax(logprobs)
        elif self.draw == "inverse_cdf":
            tokens = _categorical(key, logprobs)
        else:
            tokens = _noise_max(key, logprobs, self.draw)
        chosen = jnp.take_along_axis(logprobs, tokens[..., None], axis=-1)[..., 0]
        return tokens, chosen


def _nucleus_threshold(ranked: jax.Array, top_p: float, log_norm: jax.Array | None = None) -> jax.Array:
    """Smallest logit of the nucleus: the shortest prefix of the descending `ranked` with mass >= top_p.

    A token is kept when the probability mass strictly before it is < top_p (transformers' rule),
    so the most likely token is always kept. `log_norm` [..., 1]: the log normaliser when `ranked` is a prefix
    of the distribution's support (default: `ranked` is all of it).
    """
    probs = jax.nn.softmax(ranked, axis=-1) if log_norm is None else jnp.exp(ranked - log_norm)  # [..., K]
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    num_kept = jnp.sum(mass_before < top_p, axis=-1, keepdims=True)  # [..., 1], >= 1
    return jnp.take_along_axis(ranked, num_kept - 1, axis=-1)[..., 0]


def _ordered_bits(x: jax.Array) -> jax.Array:
    """float32 -> uint32 in the same order (negative floats' bits reversed), so a threshold is a 32-bit search."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _bisected_threshold(scaled: jax.Array, top_k: int, top_p: float) -> jax.Array:
    """The top-k and top-p thresholds of `_nucleus_threshold` on top of lax.top_k, found without sorting.

    The k-th largest logit is the largest t with count(x >= t) >= k; the nucleus's smallest logit is the
    smallest t with mass(x > t) < top_p (the mass strictly before it is < top_p, ties kept), the mass taken
    over the top-k renormalised distribution. Both conditions are monotone in t, so each is 32 halvings of the
    uint32 range of `_ordered_bits`, exact for the count (ties included), the sum's order aside for the mass.
    """
    keys = _ordered_bits(scaled)  # [..., V]

    def search(holds_at, lo, hi, want_largest: bool):
        # Invariant: the answer is in [lo, hi]. Largest t that holds: mid rounds up; smallest: mid rounds down.
        def halve(_, bounds):
            lo, hi = bounds
            mid = lo + (hi - lo) // 2 + (hi - lo) % 2 if want_largest else lo + (hi - lo) // 2
            ok = holds_at(mid)
            return (jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)) if want_largest else \
                (jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi))
        return jax.lax.fori_loop(0, 32, halve, (lo, hi))[0]

    lowest, highest = jnp.min(keys, axis=-1), jnp.max(keys, axis=-1)
    kth = lowest
    if top_k:
        kth = search(lambda t: jnp.sum(keys >= t[..., None], axis=-1) >= top_k, lowest, highest, True)
    if top_p < 1:
        inside = keys >= kth[..., None]
        probs = jax.nn.softmax(jnp.where(inside, scaled, -jnp.inf), axis=-1)
        mass_above = lambda t: jnp.sum(jnp.where(keys > t[..., None], probs, 0.0), axis=-1)  # noqa: E731
        kth = search(lambda t: mass_above(t) < top_p, kth, highest, False)
    # Back to the float (the search stops only at keys the row attains: it is one of the row's logits).
    bits = jnp.where(kth >> 31 == 1, kth & jnp.uint32(0x7FFFFFFF), ~kth)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _argmax(x: jax.Array) -> jax.Array:
    """First index of the maximum over the last axis, as int32.

    Same result as jnp.argmax, but two plain reductions: XLA:CPU lowers argmax to a variadic
    reduce that is much slower over a 50k vocabulary (docs/benchmarks.md#sampler), and the decode loop calls
    this every token.
    """
    vocab = x.shape[-1]
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    first = jnp.min(jnp.where(x == jnp.max(x, axis=-1, keepdims=True), iota, vocab), axis=-1)
    return jnp.minimum(first, vocab - 1)  # NaN logits match nothing: return some valid id, not vocab


def _flat_row_keys(key: jax.Array, batch_shape: tuple[int, ...]) -> jax.Array | None:
    """The per-row keys flattened to [R] (None for one key), or a ValueError naming a mismatch."""
    key_shape = key.shape if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) else key.shape[:-1]
    if key_shape == ():
        return None
    if key_shape != batch_shape:
        raise ValueError(f"keys of shape {key_shape} do not match the rows of logits {batch_shape}")
    return key.reshape((-1,) + key.shape[len(key_shape):])


def _noise_max(key: jax.Array, logprobs: jax.Array, draw: str) -> jax.Array:
    """One draw per row by the Gumbel-max trick: argmax(logprobs + Gumbel noise), V random numbers per row.

    `gumbel` adds the noise itself and takes the first maximum with two plain reductions (`_argmax`);
    `categorical` is jax.random.categorical (the same trick, XLA's argmax). -inf tokens are never chosen.
    """
    batch_shape, vocab = logprobs.shape[:-1], logprobs.shape[-1]
    flat_keys = _flat_row_keys(key, batch_shape)
    logprobs = logprobs.astype(jnp.float32).reshape(-1, vocab)

    def one(k, row_shape):
        if draw == "categorical":
            return lambda lp: jax.random.categorical(k, lp, axis=-1).astype(jnp.int32)
        return lambda lp: _argmax(lp + jax.random.gumbel(k, row_shape, jnp.float32))

    if flat_keys is None:
        tokens = one(key, logprobs.shape)(logprobs)
    else:
        tokens = jax.vmap(lambda k, lp: one(k, (vocab,))(lp))(flat_keys, logprobs)
    return tokens.reshape(batch_shape)


_BLOCK = 256  # tokens per block of the two-level inverse CDF


def _categorical(key: jax.Array, logprobs: jax.Array) -> jax.Array:
    """One draw per row from exp(logprobs) [..., V]; `key` is one key, or one key per row.

    Inverse-CDF sampling with one uniform per row, exact up to float32 rounding (like
    torch.multinomial). It replaces jax.random.categorical's Gumbel-max trick, which needs V random
    numbers per row: on CPU that costs far more than the model's logits matmul leaves to spare
    (docs/configuration.md, `sampler.draw`).
    The CDF is walked in two levels (block sums, then one block) so no length-V cumsum is needed.
    A token of probability 0 (-inf) is never returned: it adds nothing to any cumulative sum.
    """
    batch_shape, vocab = logprobs.shape[:-1], logprobs.shape[-1]
    flat_keys = _flat_row_keys(key, batch_shape)
    if flat_keys is None:
        uniform = jax.random.uniform(key, batch_shape, jnp.float32)
    else:
        uniform = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(flat_keys).reshape(batch_shape)
    block = min(_BLOCK, vocab)
    num_blocks = -(-vocab // block)
    probs = jnp.exp(logprobs.astype(jnp.float32).reshape(-1, vocab))  # [R, V]
    probs = jnp.pad(probs, ((0, 0), (0, num_blocks * block - vocab))).reshape(-1, num_blocks, block)  # [R, C, K]
    block_cdf = jnp.cumsum(jnp.sum(probs, axis=-1), axis=-1)  # [R, C]
    target = uniform.reshape(-1) * block_cdf[:, -1]  # [R] in [0, total)
    # The chosen block j has cdf[j-1] <= target < cdf[j], hence a positive mass.
    j = jnp.minimum(jnp.sum(block_cdf <= target[:, None], axis=-1), num_blocks - 1)  # [R]
    before = jnp.where(j > 0, jnp.take_along_axis(block_cdf, jnp.maximum(j - 1, 0)[:, None], 1)[:, 0], 0.0)
    in_block = jnp.take_along_axis(probs, j[:, None, None], axis=1)[:, 0]  # [R, K]
    i = jnp.sum(jnp.cumsum(in_block, axis=-1) <= (target - before)[:, None], axis=-1)
    # Rounding can push i one past the block's mass; fall back to its last token of positive probability.
    last_positive = jnp.max(jnp.where(in_block > 0, jnp.arange(block), -1), axis=-1)
    tokens = j * block + jnp.minimum(i, last_positive)
    return tokens.astype(jnp.int32).reshape(batch_shape)
