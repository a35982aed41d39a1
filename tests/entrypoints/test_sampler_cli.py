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


def test_cli_greedy_on_a_transformers_qwen3_moe_prints_its_greedy_completions(tmp_path, capsys):
    # A tiny random Qwen3MoeForCausalLM saved by transformers (SmolLM2's tokenizer beside it): jgrpo's greedy
    # completions, prompts of two lengths batched with left padding, equal transformers' one prompt at a time.
    # Periodic, decoder_sparse_step 2 over 4 layers (0 and 2 dense MLPs): both kinds of layer, the super-layer scan.
    # (Every layer a mixture of experts: tests/models/test_model_parity.py against transformers.)
    import torch
    import transformers

    from jgrpo.data.prompts import chat_prompt_ids
    from jgrpo.models.hf import load_tokenizer
    from jgrpo.sampling.sampler import stop_ids_for

    tokenizer = load_tokenizer("tiny-random-llama")
    config = transformers.Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=4,
        decoder_sparse_step=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, initializer_range=0.2, tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).float().eval()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    prompts, new = ["Hi", "What is the capital of France? Answer briefly."], 10
    assert main([str(tmp_path), *(x for p in prompts for x in ("--prompt", p)), "--temperature", "0",
                 "--max-new-tokens", str(new)]) == 0
    printed = capsys.readouterr().out.splitlines()
    stops = stop_ids_for(tokenizer)
    for i, prompt in enumerate(prompts):
        ids = chat_prompt_ids(tokenizer, prompt)
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=new, eos_token_id=list(stops),
                                 pad_token_id=tokenizer.pad_token_id)[0, len(ids):].tolist()
        ref = ref[:next((j + 1 for j, t in enumerate(ref) if t in stops), len(ref))]
        header = printed.index(next(line for line in printed if line.startswith(f"=== prompt {i} sample 0")))
        assert printed[header].startswith(f"=== prompt {i} sample 0 ({len(ref)} tokens")
        assert printed[header + 2] == tokenizer.decode(ref, skip_special_tokens=True).strip()
