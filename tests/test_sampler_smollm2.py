"""The sampler on the real SmolLM2-135M-Instruct weights: greedy == transformers, log-probs == trainer's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jgrpo.data.prompts import chat_prompt_ids, left_pad, pad_id_for
from jgrpo.logprobs import token_logprobs
from jgrpo.models.hf import load_model, load_tokenizer, resolve_model_dir
from jgrpo.models.llm import merge_model, position_ids_from_mask
from jgrpo.sampler import SamplingMethod, generate, stop_ids_for

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
MESSAGES = [
    "What is the capital of France?",
    "Write a short poem about autumn leaves falling in a quiet park.",
    "Explain in two sentences why the sky is blue, for a ten year old who loves science.",
    "2+2=?",
]


@pytest.fixture(scope="module")
def smollm2():
    tokenizer = load_tokenizer(MODEL)
    graphdef, params, _ = load_model(MODEL)
    prompts = [chat_prompt_ids(tokenizer, m) for m in MESSAGES]
    assert len({len(p) for p in prompts}) == len(prompts)  # really different lengths
    tokens, mask = left_pad(prompts, pad_id=pad_id_for(tokenizer), bucket=16)
    return tokenizer, graphdef, params, tokens, mask


def _until_stop(row, stops):
    out = []
    for t in row:
        out.append(int(t))
        if t in stops:
            break
    return out


def test_greedy_matches_transformers(smollm2):
    tokenizer, graphdef, params, tokens, mask = smollm2
    stops = stop_ids_for(tokenizer)
    new = 48
    out = generate(graphdef, params, tokens, mask, num_samples=1, max_new_tokens=new,
                   method=SamplingMethod(temperature=0), stop_ids=stops, key=jax.random.key(0),
                   pad_id=tokenizer.pad_token_id)
    hf = transformers.AutoModelForCausalLM.from_pretrained(resolve_model_dir(MODEL), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor(tokens, dtype=torch.long), attention_mask=torch.tensor(mask, dtype=torch.long),
                          do_sample=False, max_new_tokens=new, eos_token_id=list(stops),
                          pad_token_id=tokenizer.pad_token_id)[:, tokens.shape[1]:].numpy()
    for b, message in enumerate(MESSAGES):
        ours = _until_stop(np.asarray(out.tokens[b]), stops)
        theirs = _until_stop(ref[b], stops)
        assert ours == theirs, f"{message!r}:\n ours   {tokenizer.decode(ours)!r}\n theirs {tokenizer.decode(theirs)!r}"
        assert int(out.lengths[b]) == len(ours)
    assert out.truncated.any() and not out.truncated.all()  # both endings exercised


def test_logprobs_match_trainer_recompute(smollm2):
    tokenizer, graphdef, params, tokens, mask = smollm2
    method = SamplingMethod(temperature=0.7, top_k=50)
    G = 2  # noqa: N806
    out = generate(graphdef, params, tokens, mask, num_samples=G, max_new_tokens=24, method=method,
                   stop_ids=stop_ids_for(tokenizer), key=jax.random.key(4), pad_id=tokenizer.pad_token_id)
    full = jnp.concatenate([jnp.repeat(tokens, G, 0), out.tokens], axis=1)
    full_mask = jnp.concatenate([jnp.repeat(mask, G, 0), out.completion_mask], axis=1)
    model = merge_model(graphdef, params)
    hidden, _ = model(full, position_ids_from_mask(full_mask), full_mask)
    P, N = tokens.shape[1], out.tokens.shape[1]  # noqa: N806
    lp, _ = token_logprobs(hidden[:, P - 1 : P + N - 1], model.unembedding(), out.tokens, chunk=8,
                           process_logits=method.process_logits)
    completion = np.asarray(out.completion_mask)
    np.testing.assert_allclose(np.asarray(out.logprobs)[completion], np.asarray(lp)[completion], atol=1e-4, rtol=0)
