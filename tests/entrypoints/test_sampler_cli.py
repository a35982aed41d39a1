"""`python -m jgrpo.sample` end to end on the tiny random built-in model."""

import pytest

from jgrpo.sample import main


def test_cli_prints_every_completion(capsys):
    code = main(["tiny-random-llama", "--prompt", "Hello there", "--prompt", "What is 2+2?", "--num-samples", "2",
                 "--max-new-tokens", "5", "--temperature", "0.8", "--top-k", "20", "--seed", "3"])
    assert code == 0
    out = capsys.readouterr().out
    for prompt in range(2):
        for sample in range(2):
            assert f"=== prompt {prompt} sample {sample} (" in out
    assert ">>> What is 2+2?" in out


def test_cli_greedy_is_deterministic(capsys):
    argv = ["tiny-random-llama", "--prompt", "Hi", "--max-new-tokens", "6", "--temperature", "0"]
    main(argv + ["--seed", "1"])
    first = capsys.readouterr().out
    main(argv + ["--seed", "2"])
    assert capsys.readouterr().out == first  # greedy ignores the seed


@pytest.mark.parametrize("flag,value,message", [("--top-p", "1.5", "top_p"), ("--temperature", "-1", "temperature")])
def test_cli_rejects_bad_settings(capsys, flag, value, message):
    assert main(["tiny-random-llama", "--prompt", "Hi", flag, value]) == 2
    assert message in capsys.readouterr().err


def test_cli_rejects_too_long_prompts(capsys):
    assert main(["tiny-random-llama", "--prompt", "word " * 50, "--max-prompt-length", "8"]) == 2
    assert "max_prompt_length=8" in capsys.readouterr().err
