"""`python -m jgrpo.export` of a LoRA run: the merged model in transformers, and the adapters in PEFT on the
transformers base, both with the logits of jgrpo's base + adapters (1e-4)."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from jgrpo.config.loading import save_config
from jgrpo.export import main as export_main
from jgrpo.models.builtin import resolve_model_dir
from jgrpo.models.llm import forward, merge_model, position_ids_from_mask
from jgrpo.training.trainer import Trainer
from tests.helpers import tiny_config

TOKENS = np.array([[1, 504, 3458, 314, 216, 28, 1065, 42], [7, 7, 90, 12, 300, 5, 8, 2]], np.int32)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A LoRA run of two iterations with a large learning rate (adapters far from zero), and its final logits."""
    run_dir = tmp_path_factory.mktemp("lora_run")
    config = tiny_config(run_dir, "model.lora.rank=4", "model.lora.alpha=8", "model.lora.targets=[q,o,up,down]",
                         "optim.learning_rate=5e-2", "run.iterations=2", "logging.samples_every=0")
    save_config(config, run_dir)  # as `python -m jgrpo.train` does: export reads the run's config
    trainer = Trainer(config)
    try:
        assert trainer.run() == "done"
        mask = np.ones_like(TOKENS, bool)

        def logits(graphdef, params):
            hidden, _ = forward(graphdef, params, TOKENS, position_ids_from_mask(mask), mask)
            return np.asarray(merge_model(graphdef, params).logits(hidden))

        adapted = logits(trainer.graphdef, trainer.frozen.join(trainer.state.params))
        return run_dir, adapted, logits(trainer.steps.model.base_graphdef, trainer.frozen.train)
    finally:
        trainer.close()


def _hf_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(TOKENS, dtype=torch.long)).logits.float().numpy()


def test_merged_export_loads_in_transformers_with_the_adapted_logits(lora_run, tmp_path):
    run_dir, ours, base = lora_run
    assert np.abs(ours - base).max() > 1e-2  # the adapters change the model: the comparison below means something
    assert export_main([str(run_dir), str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", torch_dtype=torch.float32)
    np.testing.assert_allclose(_hf_logits(merged), ours, rtol=1e-4, atol=1e-4)
    # jgrpo.eval of the exported directory evaluates those weights and says where they came from (not "untrained").
    from jgrpo.eval import load_for_eval

    _, graphdef, params, _, _, source = load_for_eval(str(tmp_path / "merged"), [])
    assert source == f"model directory {tmp_path / 'merged'}"
    mask = np.ones_like(TOKENS, bool)
    hidden, _ = forward(graphdef, params, TOKENS, position_ids_from_mask(mask), mask)
    np.testing.assert_allclose(np.asarray(merge_model(graphdef, params).logits(hidden)), ours, rtol=1e-4, atol=1e-4)


def test_adapters_only_export_loads_in_peft_on_the_transformers_base(lora_run, tmp_path):
    from peft import PeftModel

    run_dir, ours, _ = lora_run
    assert export_main([str(run_dir), str(tmp_path / "adapters"), "--adapters-only"]) == 0
    assert sorted(p.name for p in (tmp_path / "adapters").iterdir()) == ["adapter_config.json",
                                                                         "adapter_model.safetensors"]
    base = AutoModelForCausalLM.from_pretrained(resolve_model_dir("tiny-random-llama"), torch_dtype=torch.float32)
    model = PeftModel.from_pretrained(base, tmp_path / "adapters").eval()
    np.testing.assert_allclose(_hf_logits(model), ours, rtol=1e-4, atol=1e-4)


def test_adapters_only_of_a_full_run_names_the_problem(tmp_path, capsys):
    run_dir = tmp_path / "full"
    config = tiny_config(run_dir, "run.iterations=1", reward=None)
    save_config(config, run_dir)
    trainer = Trainer(config)
    try:
        assert trainer.run() == "done"
    finally:
        trainer.close()
    assert export_main([str(run_dir), str(tmp_path / "out"), "--adapters-only"]) == 2
    message = " ".join(capsys.readouterr().err.split())  # the paragraph is wrapped at spaces
    assert "trained full params (model.lora.rank=0): it has no adapters to export" in message


def test_eval_reads_the_adapters_onto_the_base(lora_run):
    from jgrpo.eval import load_for_eval

    run_dir, ours, _ = lora_run
    _, graphdef, params, _, _, source = load_for_eval(str(run_dir), [])
    assert source.endswith("at iteration 2")
    mask = np.ones_like(TOKENS, bool)
    hidden, _ = forward(graphdef, params, TOKENS, position_ids_from_mask(mask), mask)
    np.testing.assert_allclose(np.asarray(merge_model(graphdef, params).logits(hidden)), ours, rtol=1e-6, atol=1e-6)
