"""Token in, token out: an episode's ids are the prompt, the sampled ids and the appended deltas, and for turns
scripted as the tokenizer's own ids they equal tokenizing the rendered transcript (nothing re-tokenized)."""

import logging
from pathlib import Path

import pytest

from jgrpo.config import EnvConfig
from jgrpo.envs.rendering import Renderer
from jgrpo.envs.toolbox import build_tools
from jgrpo.envs.tools import Calculator
from jgrpo.models.builtin import resolve_model_dir
from jgrpo.models.hf import load_tokenizer

# The official Qwen2.5 and Qwen3 chat templates, as published (copies kept by huggingface/trl in
# trl/chat_templates/; the Qwen2.5 one identical to llama.cpp's copy).
TEMPLATES = Path(__file__).resolve().parents[1] / "testdata" / "chat_templates"


@pytest.fixture(scope="module")
def smollm2():
    return load_tokenizer(str(resolve_model_dir("tiny-random-llama")))  # SmolLM2-135M-Instruct's tokenizer


def with_template(tokenizer, name):
    path = TEMPLATES / f"{name}.jinja"
    if not path.exists():
        pytest.skip(f"{path} is missing")
    copy = load_tokenizer(str(resolve_model_dir("tiny-random-llama")))
    copy.chat_template = path.read_text()
    return copy


def play(renderer, tokenizer, opening, script):
    """ids of an episode whose turns are `script` [(assistant text, stopped, reply messages)], each turn's ids
    the tokenizer's own (as a model that writes exactly them): (ids, transcript)."""
    transcript, ids = renderer.prompt(opening)
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for text, stopped, reply in script:
        ids += tokenizer(text, add_special_tokens=False)["input_ids"] + ([stop] if stopped else [])
        transcript.append({"role": "assistant", "content": text})
        if reply is not None:
            ids += renderer.delta(reply, stop if stopped else None)
            transcript += reply
    return ids, transcript


def test_hermes_prompt_is_the_template_with_tools_in_the_system_prompt(smollm2):
    renderer = Renderer(smollm2, tools=[Calculator()], tool_format="auto")
    assert renderer.format == "hermes"  # SmolLM2's template ignores tools=
    transcript, ids = renderer.prompt([{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "What is 345 * 67?"}])
    system = transcript[0]["content"]
    assert system.startswith("Be brief.\n\n") and "<tools>\n" in system and '"name": "calculator"' in system
    assert '<tool_call>\n{"name": "calculator", "arguments": {"expression": "(12 + 3) * 4"}}\n</tool_call>' in system
    expected = smollm2.apply_chat_template(transcript, tokenize=False, add_generation_prompt=True)
    assert ids == smollm2(expected, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("template", ["smollm2", "qwen2_5"])
def test_sampled_plus_appended_ids_equal_the_rendered_transcript(smollm2, template):
    tokenizer = smollm2 if template == "smollm2" else with_template(smollm2, template)
    renderer = Renderer(tokenizer, tools=build_tools(["calculator"], EnvConfig()), tool_format="auto")
    assert renderer.format == ("hermes" if template == "smollm2" else "template")
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "345 * 67"}}\n</tool_call>'
    ids, transcript = play(renderer, tokenizer, [{"role": "user", "content": "What is 345 * 67?"}], [
        (call, True, [{"role": "tool", "name": "calculator", "content": "23115"}]),
        ("Let me check.", True, [{"role": "user", "content": "Go on."}]),
        ("345 * 67 = 23115", True, None),
    ])
    rendered = renderer._render(transcript, False)
    assert rendered.endswith("<|im_end|>\n")  # the episode ends at its last sampled token, the stop token
    assert ids == tokenizer(rendered.removesuffix("\n"), add_special_tokens=False)["input_ids"]


def test_a_turn_cut_before_its_stop_token_gets_the_turn_close_appended(smollm2):
    renderer = Renderer(smollm2)
    delta = renderer.delta([{"role": "user", "content": "Higher."}], None)
    assert smollm2.decode(delta) == "<|im_end|>\n<|im_start|>user\nHigher.<|im_end|>\n<|im_start|>assistant\n"
    stopped = renderer.delta([{"role": "user", "content": "Higher."}], smollm2.convert_tokens_to_ids("<|im_end|>"))
    assert smollm2.decode(stopped) == "\n<|im_start|>user\nHigher.<|im_end|>\n<|im_start|>assistant\n"


def test_turn_prefix_and_raw_ids(smollm2):
    renderer = Renderer(smollm2, turn_prefix="<tool_call>")
    transcript, ids = renderer.prompt([{"role": "user", "content": "hi"}])
    assert smollm2.decode(ids).endswith("<|im_start|>assistant\n<tool_call>")
    assert smollm2.decode(renderer.delta([{"role": "user", "content": "x"}], None)).endswith("assistant\n<tool_call>")
    assert renderer.delta([5, 6, 7], None) == [5, 6, 7]
    assert renderer.turn_text([28, 29, 2], stopped=True).startswith("<tool_call>")
    # A first-turn prefix: the prompt ends with it, later turns start with turn_prefix (here none).
    opening = '<tool_call>{"name": "calculator", "arguments": {"expression": "'
    renderer = Renderer(smollm2, first_turn_prefix=opening)
    assert smollm2.decode(renderer.prompt([{"role": "user", "content": "hi"}])[1]).endswith("assistant\n" + opening)
    assert smollm2.decode(renderer.delta([{"role": "user", "content": "x"}], None)).endswith("assistant\n")
    assert renderer.turn_text(smollm2.encode('2*3"}}</tool_call>'), stopped=False, first=True) == (
        opening + '2*3"}}</tool_call>')
    assert renderer.turn_text(smollm2.encode("6"), stopped=False) == "6"


def test_a_long_reply_is_cut_to_max_append_tokens(smollm2):
    renderer = Renderer(smollm2)
    ids, cut = renderer.delta_within([{"role": "tool", "content": "9" * 2000}], None, 64)
    assert cut and len(ids) <= 64
    assert smollm2.decode(ids).endswith(" [truncated]<|im_end|>\n<|im_start|>assistant\n")
    ids, cut = renderer.delta_within([{"role": "tool", "content": "12"}], None, 64)
    assert not cut


def test_qwen3_keeps_the_exact_ids_and_warns_once(smollm2, caplog):
    tokenizer = with_template(smollm2, "qwen3")
    renderer = Renderer(tokenizer)
    ids, transcript = play(renderer, tokenizer, [{"role": "user", "content": "Guess."}], [
        ("<think>\nlow or high\n</think>\n\n50", True, [{"role": "user", "content": "Higher."}]),
        ("<think>\nhigher\n</think>\n\n75", True, None),
    ])
    with caplog.at_level(logging.WARNING, logger="jgrpo.envs"):
        for _ in range(2):  # as the runner calls it after the first turn: the transcript ends with that turn
            renderer.check_append_only(transcript[:2], [{"role": "user", "content": "Higher."}])
    assert sum("not append-only" in r.message for r in caplog.records) == 1
    # The ids are what was sampled and appended: the first turn's <think> block is still there.
    assert tokenizer.decode(ids).count("low or high") == 1
    rendered = renderer._render(transcript, False)
    assert "low or high" not in rendered  # re-rendering would have dropped it
