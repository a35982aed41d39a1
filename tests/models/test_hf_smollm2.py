"""Real SmolLM2-135M-Instruct: jgrpo's built-in conversion against transformers reading the GGUF itself."""

import numpy as np
import pytest
import torch
import transformers

from jgrpo.models import builtin
from jgrpo.models.hf import load_model, load_tokenizer
from tests.helpers_models import hf_logits, jgrpo_logits

PROMPTS = [
    [{"role": "user", "content": "What is 12 + 7? Answer with a number."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime."}],
    [{"role": "user", "content": "Hi"}],
]


@pytest.mark.slow
def test_smollm2_logits_match_transformers_from_gguf():
    graphdef, params, cfg = load_model("smollm2-135m-instruct")
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.num_kv_heads) == (30, 576, 9, 64, 3)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.rope_theta, cfg.rms_norm_eps) == (1536, 49152, 1e5, 1e-5)
    assert cfg.tie_word_embeddings

    tokenizer = load_tokenizer("smollm2-135m-instruct")
    tokenizer.padding_side = "left"
    texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in PROMPTS]
    batch = tokenizer(texts, return_tensors="np", padding=True)
    tokens, mask = batch["input_ids"].astype(np.int32), batch["attention_mask"].astype(bool)
    assert len(set(mask.sum(1))) == len(PROMPTS)  # different lengths, so real left padding

    gguf = builtin.smollm2_gguf_path()
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, attn_implementation="eager", dtype=torch.float32
    )
    assert all(p.dtype == torch.float32 for p in reference.parameters())
    expected = hf_logits(reference.eval(), tokens, mask)
    ours = jgrpo_logits(graphdef, params, tokens, mask)
    np.testing.assert_allclose(ours[mask], expected[mask], atol=1e-3, rtol=0)
    # Same greedy continuation token at every real position.
    np.testing.assert_array_equal(ours[mask].argmax(-1), expected[mask].argmax(-1))
