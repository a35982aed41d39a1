"""The sampler runs recorded from the slot pool's ring cache before the paged cache replaced it (tests/testdata/
sampler_golden.npz, written by `python scripts/record_sampler_golden.py REV`), and rerun by
tests/sampling/test_sampler_golden.py: the same code drives both engines, with the options both take.

Cases: the tiny Llama (tests/helpers_models.py) greedy and sampled, static and continuous (3 slots), the scanned
decode, an int8 cache; and a multi-turn run through the slot interface, every turn of 4 tokens answered with two
ids, row 1's turns parked while row 0 goes on, three turns a row. SmolLM2-135M-Instruct (`slow`): greedy and
sampled, static and continuous, on two chat prompts.
"""

from __future__ import annotations

import jax
import numpy as np

STOPS = tuple(range(2, 14))
FIELDS = ("tokens", "logprobs", "lengths", "loss_mask")


def tiny_cases():
    from jgrpo.sampling.sampler import SamplingMethod

    sampled, greedy = SamplingMethod(temperature=1.0), SamplingMethod(temperature=0)
    common = dict(max_new_tokens=12, stop_ids=STOPS)
    return {"greedy": dict(num_samples=1, method=greedy, **common),
            "sampled": dict(num_samples=3, method=sampled, **common),
            "continuous": dict(num_samples=3, method=sampled, slots=3, **common),
            "scanned": dict(num_samples=2, method=sampled, decode_layers="scanned", **common),
            "int8": dict(num_samples=2, method=sampled, kv_cache_dtype="int8", **common)}


def smollm2_cases():
    from jgrpo.sampling.sampler import SamplingMethod

    common = dict(max_new_tokens=48)
    return {"smollm2_greedy": dict(num_samples=1, method=SamplingMethod(temperature=0), **common),
            "smollm2_sampled": dict(num_samples=4, method=SamplingMethod(temperature=1.0), **common),
            "smollm2_continuous": dict(num_samples=4, method=SamplingMethod(temperature=1.0), slots=3, **common)}


def generate(graphdef, params, prompts, options, key=3) -> dict:
    from jgrpo.sampling.sampler import Sampler

    out = jax.device_get(Sampler(graphdef, **options).generate(params, prompts, jax.random.key(key)))
    return {f: np.asarray(getattr(out, f)) for f in FIELDS}


def multi_turn(graphdef, params, prompts) -> dict:
    """Two rows, turns of 4 drawn tokens, each answered with two ids; row 1's turns park while row 0 decodes and
    resume in a free slot; three turns a row. Returns the drained rows (row order)."""
    from jgrpo.sampling.sampler import Sampler, SamplingMethod
    from jgrpo.sampling.turns import DONE, EMPTY, PAUSED

    sampler = Sampler(graphdef, max_new_tokens=24, num_samples=1, method=SamplingMethod(temperature=1.0),
                      turn_tokens=4, decode_chunk=2)
    state = sampler.start(params, prompts, jax.random.key(4))
    turns, parked, drained = {0: 0, 1: 0}, [], {}
    for _ in range(200):
        status = state.status()
        for slot in np.flatnonzero(status.state == PAUSED):
            row = int(status.row[slot])
            turns[row] += 1
            if turns[row] == 3:
                state = sampler.finish(state, slot)
            elif row == 1:
                state, _ = sampler.park(state, slot)
                parked.append(row)
            else:
                state = sampler.append(params, state, slot, [7 + turns[row], 8])
        status = state.status()
        free = [s for s in range(len(status.state)) if status.state[s] in (DONE, EMPTY)]
        if parked and free and (turns[0] == 3 or state.idle()):
            row = parked.pop()
            state = sampler.resume(params, state, free[0], row, [20 + turns[row], 21])
        rows, out, state = sampler.drain(state)
        drained.update({int(r): jax.tree.map(lambda x, i=i: np.asarray(x)[i], out) for i, r in enumerate(rows)})
        if len(drained) == 2:
            break
        state = sampler.advance(params, state)
    return {f: np.stack([np.asarray(getattr(drained[r], f)) for r in sorted(drained)]) for f in FIELDS}


def smollm2_prompts():
    from jgrpo.data.prompts import chat_prompt_ids, left_pad, pad_id_for
    from jgrpo.models.hf import load_tokenizer
    from jgrpo.sampling.sampler import Prompts, stop_ids_for

    tokenizer = load_tokenizer("smollm2-135m-instruct")
    ids = [chat_prompt_ids(tokenizer, q) for q in ("What is 17 + 25?", "Name a prime number above 100.")]
    tokens, mask = left_pad(ids, pad_id=pad_id_for(tokenizer), bucket=16)
    return Prompts(tokens, mask), {"stop_ids": stop_ids_for(tokenizer), "pad_id": pad_id_for(tokenizer)}


def record_all(tiny_model, smollm2: bool) -> dict:
    """Every case: {case/field: array}."""
    from jgrpo.sampling.sampler import Prompts
    from tests.helpers_models import sampler_prompts

    graphdef, params = tiny_model
    prompts = Prompts(*sampler_prompts())
    out = {}
    for name, options in tiny_cases().items():
        out.update({f"{name}/{f}": v for f, v in generate(graphdef, params, prompts, options).items()})
    two = Prompts(prompts.tokens[:2], prompts.mask[:2])
    out.update({f"multi_turn/{f}": v for f, v in multi_turn(graphdef, params, two).items()})
    if smollm2:
        from jgrpo.models.hf import load_model

        graphdef, params, _ = load_model("smollm2-135m-instruct")
        prompts, ids = smollm2_prompts()
        for name, options in smollm2_cases().items():
            out.update({f"{name}/{f}": v for f, v in generate(graphdef, params, prompts, {**options, **ids}).items()})
    return out
