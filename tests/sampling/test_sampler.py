"""The decode loop on tiny random checkpoints: transformers parity, log-prob parity, stops, seeds, sharding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jgrpo.config import MeshConfig
from jgrpo.data.prompts import left_pad
from jgrpo.models.llm import merge_model, position_ids_from_mask
from jgrpo.parallel.mesh import make_mesh
from jgrpo.rl.logprobs import token_logprobs
from jgrpo.sampling.sampler import SamplingMethod
from tests.helpers import generate
from tests.helpers_models import SAMPLER_PROMPTS, sampler_model, sampler_prompts


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def family_model(request, tmp_path_factory):
    """(torch model, (graphdef, params, cfg)) of one family, the same weights on both sides."""
    return sampler_model(request.param, tmp_path_factory.mktemp(request.param))


def _first_stop_prefix(row, stop_ids):
    row = list(row)
    for i, t in enumerate(row):
        if t in stop_ids:
            return row[: i + 1]
    return row


def test_greedy_matches_transformers_generate(family_model):
    hf_model, (graphdef, params, _) = family_model
    tokens, mask = sampler_prompts()
    new = 12
    stop_ids = (2,)
    out = generate(graphdef, params, tokens, mask, num_samples=1, max_new_tokens=new,
                   method=SamplingMethod(temperature=0), stop_ids=stop_ids, key=jax.random.key(0))
    with torch.no_grad():
        ref = hf_model.generate(
            torch.tensor(tokens, dtype=torch.long), attention_mask=torch.tensor(mask, dtype=torch.long),
            do_sample=False, max_new_tokens=new, eos_token_id=list(stop_ids), pad_token_id=0,
        )[:, tokens.shape[1]:].numpy()
    ours = np.asarray(out.tokens)
    for b in range(len(SAMPLER_PROMPTS)):
        expected = _first_stop_prefix(ref[b], stop_ids)
        assert _first_stop_prefix(ours[b], stop_ids) == expected, f"row {b}"
        assert int(out.lengths[b]) == len(expected)
        assert bool(out.truncated[b]) == (expected[-1] not in stop_ids)
    np.testing.assert_array_equal(out.logprobs, 0.0)  # greedy samples from a point mass


def _recomputed_logprobs(graphdef, params, tokens, mask, out, method):
    """The trainer's view: one full forward over [prompt | completion], then log-probs of the completion."""
    G = out.tokens.shape[0] // tokens.shape[0]
    full = jnp.concatenate([jnp.repeat(tokens, G, 0), out.tokens], axis=1)
    full_mask = jnp.concatenate([jnp.repeat(mask, G, 0), out.completion_mask], axis=1)
    model = merge_model(graphdef, params)
    hidden, _ = model(full, position_ids_from_mask(full_mask), full_mask)
    P, N = tokens.shape[1], out.tokens.shape[1]
    lp, _ = token_logprobs(hidden[:, P - 1 : P + N - 1], model.unembedding(), out.tokens, chunk=5,
                           process_logits=method.process_logits)
    return np.where(out.completion_mask, lp, 0.0)


@pytest.mark.parametrize(
    "method",
    [SamplingMethod(temperature=0.7), SamplingMethod(temperature=1.3, top_k=7), SamplingMethod(top_p=0.8, min_p=0.05)],
    ids=str,
)
def test_logprobs_match_trainer_recompute(tiny_llama, method):
    graphdef, params = tiny_llama
    tokens, mask = sampler_prompts()
    out = generate(graphdef, params, tokens, mask, num_samples=3, max_new_tokens=10, method=method,
                   stop_ids=(2,), key=jax.random.key(1))
    recomputed = _recomputed_logprobs(graphdef, params, tokens, mask, out, method)
    drawn = np.asarray(out.logprobs)[np.asarray(out.completion_mask)]
    assert np.mean(drawn < 0) > 0.8  # real draws (a truncation may rarely leave a single token: log-prob 0)
    np.testing.assert_allclose(out.logprobs, recomputed, atol=1e-4, rtol=0)
    np.testing.assert_array_equal(np.asarray(out.logprobs)[~np.asarray(out.completion_mask)], 0.0)


def test_stop_ids_end_rows(tiny_llama):
    graphdef, params = tiny_llama
    tokens, mask = sampler_prompts()
    kwargs = dict(num_samples=1, max_new_tokens=10, method=SamplingMethod(temperature=0), key=jax.random.key(0))
    free = np.asarray(generate(graphdef, params, tokens, mask, stop_ids=(), **kwargs).tokens)
    # Stop on row 0's third greedy token and on row 2's fifth: those rows end there, the others run on.
    stops = (int(free[0, 2]), int(free[2, 4]))
    out = generate(graphdef, params, tokens, mask, stop_ids=stops, pad_id=0, **kwargs)
    for b in range(len(SAMPLER_PROMPTS)):
        hits = [i for i, t in enumerate(free[b]) if t in stops]
        length = hits[0] + 1 if hits else 10
        assert int(out.lengths[b]) == length
        assert bool(out.truncated[b]) == (not hits)
        np.testing.assert_array_equal(out.tokens[b, :length], free[b, :length])
        np.testing.assert_array_equal(out.tokens[b, length:], 0)  # pad_id after the stop
        np.testing.assert_array_equal(out.completion_mask[b], np.arange(10) < length)
    assert int(out.lengths[0]) == 3 and int(out.lengths[2]) <= 5


def test_sampled_rows_stop_at_their_first_stop_id(tiny_llama):
    graphdef, params = tiny_llama
    tokens, mask = sampler_prompts()
    stops = tuple(range(2, 30))  # many stop ids so that most rows stop early
    out = generate(graphdef, params, tokens, mask, num_samples=4, max_new_tokens=8, method=SamplingMethod(),
                   stop_ids=stops, key=jax.random.key(3), pad_id=0)
    toks, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    assert (lengths < 8).any() and not out.truncated.all()
    for r in range(toks.shape[0]):
        body = toks[r, : lengths[r]]
        assert not np.isin(body[:-1], stops).any()  # no stop before the end
        assert np.isin(body[-1], stops) != bool(out.truncated[r])


def test_same_seed_same_output_and_seeds_differ(tiny_llama):
    graphdef, params = tiny_llama
    tokens, mask = sampler_prompts()
    kwargs = dict(num_samples=2, max_new_tokens=8, method=SamplingMethod(temperature=1.5), stop_ids=())
    a = generate(graphdef, params, tokens, mask, key=jax.random.key(7), **kwargs)
    b = generate(graphdef, params, tokens, mask, key=jax.random.key(7), **kwargs)
    c = generate(graphdef, params, tokens, mask, key=jax.random.key(8), **kwargs)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
    assert (np.asarray(a.tokens) != np.asarray(c.tokens)).any()
    assert (np.asarray(a.tokens[0]) != np.asarray(a.tokens[1])).any()  # the G samples of a prompt differ


def test_sampling_keeps_no_reference_to_the_params(tiny_llama):
    """Params handed to `generate` are freed when the caller drops them, without waiting for Python's cycle
    collector: the async producer samples every iteration with a fresh published copy, and copies held by
    reference cycles until a full collection piled up (one per iteration: SmolLM2's run reached 24 GB and was
    killed). Building the model object from concrete params made such a cycle (flax's recursive flatten)."""
    import gc
    import weakref

    graphdef, params = tiny_llama
    tokens, mask = sampler_prompts()
    copy = jax.tree.map(jnp.copy, params)
    refs = [weakref.ref(x) for x in jax.tree.leaves(copy)]
    gc.disable()
    try:
        out = generate(graphdef, copy, tokens, mask, key=jax.random.key(0), num_samples=2, max_new_tokens=4,
                       method=SamplingMethod(temperature=1.0), stop_ids=())
        jax.block_until_ready(out)
        del copy, out
        alive = sum(r() is not None for r in refs)
    finally:
        gc.enable()
    assert alive == 0, f"{alive} of {len(refs)} param arrays outlive the call"


def test_shared_prefill_equals_repeated_prompts(tiny_llama):
    """G samples from one prefill == G copies of the prompt each prefilled: same rows, same keys, same draws."""
    graphdef, params = tiny_llama
    tokens, mask = sampler_prompts()
    kwargs = dict(max_new_tokens=8, method=SamplingMethod(temperature=0.9, top_k=20), stop_ids=(2,),
                  key=jax.random.key(11))
    grouped = generate(graphdef, params, tokens, mask, num_samples=3, **kwargs)
    repeated = generate(graphdef, params, np.repeat(tokens, 3, 0), np.repeat(mask, 3, 0), num_samples=1, **kwargs)
    np.testing.assert_array_equal(grouped.tokens, repeated.tokens)
    np.testing.assert_allclose(grouped.logprobs, repeated.logprobs, atol=1e-5)  # batch-size rounding only


def test_bucket_width_does_not_change_samples(tiny_llama):
    graphdef, params = tiny_llama
    kwargs = dict(num_samples=2, max_new_tokens=8, method=SamplingMethod(temperature=0.8), stop_ids=(2,),
                  key=jax.random.key(5))
    narrow = generate(graphdef, params, *sampler_prompts(bucket=1), **kwargs)
    wide = generate(graphdef, params, *sampler_prompts(bucket=16), **kwargs)
    np.testing.assert_array_equal(narrow.tokens, wide.tokens)
    np.testing.assert_allclose(narrow.logprobs, wide.logprobs, atol=1e-5)


def test_sharded_equals_unsharded(tiny_llama):
    graphdef, params = tiny_llama
    tokens, mask = sampler_prompts()
    kwargs = dict(num_samples=4, max_new_tokens=8, method=SamplingMethod(temperature=1.2, top_p=0.9),
                  stop_ids=(2,), key=jax.random.key(2))
    single = generate(graphdef, params, tokens, mask, **kwargs)
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    sharded = generate(graphdef, params, tokens, mask, mesh=mesh, **kwargs)
    assert sharded.tokens.sharding.spec[0] == ("data", "fsdp")  # rows really are split over the batch axes
    np.testing.assert_array_equal(single.tokens, sharded.tokens)
    np.testing.assert_allclose(single.logprobs, sharded.logprobs, atol=1e-5)
    np.testing.assert_array_equal(single.lengths, sharded.lengths)


def test_left_pad_prompts_buckets_and_limits():
    tokens, mask = left_pad([[1, 2, 3], [4]], pad_id=9, bucket=4)
    np.testing.assert_array_equal(tokens, [[9, 1, 2, 3], [9, 9, 9, 4]])
    np.testing.assert_array_equal(mask, [[False, True, True, True], [False, False, False, True]])
    assert left_pad([[1] * 5], pad_id=0, bucket=4)[0].shape == (1, 8)
    assert left_pad([[1] * 5], pad_id=0, bucket=4, max_length=6)[0].shape == (1, 6)  # capped
    with pytest.raises(ValueError, match="prompt 1 has 7 tokens, more than max_prompt_length=6"):
        left_pad([[1], list(range(7))], pad_id=0, max_length=6)
    tokens, mask = left_pad([[1], list(range(7))], pad_id=0, max_length=6, truncate=True)
    np.testing.assert_array_equal(tokens[1], [1, 2, 3, 4, 5, 6])  # keeps the end of the prompt
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        left_pad([[]], pad_id=0)


def test_bad_inputs_are_named(tiny_llama):
    graphdef, params = tiny_llama
    tokens, mask = sampler_prompts()
    kwargs = dict(num_samples=1, max_new_tokens=4, method=SamplingMethod(), stop_ids=(2,), key=jax.random.key(0))
    with pytest.raises(ValueError, match="left-padded"):
        generate(graphdef, params, tokens[:, ::-1], mask[:, ::-1], **kwargs)
    with pytest.raises(ValueError, match="must both be"):
        generate(graphdef, params, tokens, mask[:, 1:], **kwargs)
    with pytest.raises(ValueError, match="positions"):
        generate(graphdef, params, tokens, mask, **{**kwargs, "max_new_tokens": 250})  # past 256 positions


def test_page_sizes_and_shrinking_change_nothing_but_the_reads(tiny_llama):
    """Pages of 1, 3 and 16 tokens (a row's tokens across many pages, a prompt's last page part full, one page for
    a whole row) and a loop that halves its slots as rows finish give the same samples."""
    graphdef, params = tiny_llama
    tokens, mask = sampler_prompts()
    method = SamplingMethod(temperature=1.0)
    kwargs = dict(num_samples=3, max_new_tokens=10, method=method, stop_ids=(2, 5), key=jax.random.key(5))
    one = generate(graphdef, params, tokens, mask, page_size=16, shrink=0, **kwargs)
    assert (np.asarray(one.lengths) < 10).any() and (np.asarray(one.lengths) == 10).any()
    for options in ({"page_size": 1}, {"page_size": 3, "shrink": 2}):
        many = generate(graphdef, params, tokens, mask, **options, **kwargs)
        np.testing.assert_array_equal(many.tokens, one.tokens)
        np.testing.assert_array_equal(many.lengths, one.lengths)
        np.testing.assert_allclose(many.logprobs, one.logprobs, atol=1e-5, rtol=0)
    recomputed = _recomputed_logprobs(graphdef, params, tokens, mask, many, method)
    np.testing.assert_allclose(many.logprobs, recomputed, atol=1e-4, rtol=0)


def test_scanned_decode_layers_equal_the_unrolled_ones(tiny_llama):
    """`decode_layers=scanned` (one lax.scan over stacked weights and page pools) samples what the unrolled loop
    does, over several pages and on the 8-device mesh; `auto` keeps the unrolled loop on CPU."""
    from jgrpo.models.decode_step import resolve_decode_layers

    graphdef, params = tiny_llama
    tokens, mask = sampler_prompts()
    kwargs = dict(num_samples=2, max_new_tokens=9, method=SamplingMethod(temperature=1.0), stop_ids=(2,),
                  key=jax.random.key(7), page_size=4)
    unrolled = generate(graphdef, params, tokens, mask, **kwargs)
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    for placement in ({}, {"mesh": mesh}):
        scanned = generate(graphdef, params, tokens, mask, decode_layers="scanned", **placement, **kwargs)
        np.testing.assert_array_equal(scanned.tokens, unrolled.tokens)
        np.testing.assert_array_equal(scanned.lengths, unrolled.lengths)
        np.testing.assert_allclose(scanned.logprobs, unrolled.logprobs, atol=1e-5, rtol=0)
    assert resolve_decode_layers("auto", "cpu") == "unrolled" and resolve_decode_layers("auto", "tpu") == "scanned"
    assert resolve_decode_layers("auto", "gpu") == "unrolled"  # measured on an H100: configuration.md
    with pytest.raises(ValueError, match="decode_layers must be auto or one of"):
        generate(graphdef, params, tokens, mask, decode_layers="diagonal", **kwargs)
