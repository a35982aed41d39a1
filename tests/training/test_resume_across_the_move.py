"""A run directory written before jgrpo/ was grouped into rooms resumes after the move, where it left off.

tests/testdata/pre_move_lora_run is what commit e0d0fa3 (the last before the rooms) wrote for two iterations of
configs/tiny.yaml with LoRA adapters (rank 4), checkpointed at iteration 2 on 2 emulated devices: the resolved
config, metrics.jsonl and an Orbax checkpoint (adapters, optimiser state, data position, rng, counters, the base's
fingerprint). Config keys, checkpoint layout and run counters must not have moved with the files.
"""

import json
import logging
import shutil

import jax
import numpy as np

from jgrpo.config.loading import load_config
from jgrpo.models.hf import load_model
from jgrpo.parallel.fingerprint import fingerprint
from jgrpo.training.metrics_log import read_metrics
from jgrpo.training.trainer import Trainer
from tests.helpers import SPACE_REWARD, TESTDATA

PRE_MOVE_RUN = TESTDATA / "pre_move_lora_run"


def _train(config) -> tuple[Trainer, list]:
    trainer = Trainer(config)
    try:
        assert trainer.run() == "done"
        return trainer, jax.tree.leaves(jax.tree.map(np.asarray, jax.device_get(trainer.state.params)))
    finally:
        trainer.close()


def _rebase_on_this_machines_tiny_model(run_dir) -> None:
    """Record this machine's build of the base in the copied run, so its LoRA adapters resume on it.

    tiny-random-llama is drawn from seed 0 by XLA's CPU code, whose transcendental functions round differently on
    other CPU models (an AMD EPYC here builds weights a few ulps from those of the machine that wrote the run), so
    its content fingerprint moves between machines. The refusal itself is tested in test_lora_training.py; what
    this test holds is that config keys, checkpoint layout and counters did not move with the files.
    """
    meta_file = run_dir / "checkpoints" / "2" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    assert meta["base"]["name"] == "tiny-random-llama"
    meta["base"]["fingerprint"] = fingerprint(load_model("tiny-random-llama")[1])
    meta_file.write_text(json.dumps(meta))


def test_a_run_written_before_the_move_resumes_and_continues_as_a_straight_run(tmp_path, caplog):
    old = tmp_path / "old"
    shutil.copytree(PRE_MOVE_RUN, old)
    _rebase_on_this_machines_tiny_model(old)
    # The run's own config, as `python -m jgrpo.train RUN/config.yaml run.iterations=3` would read it; its reward
    # was the same function under its module's name before the tests were grouped too.
    overrides = ["run.iterations=3", SPACE_REWARD, "checkpoint.async_save=false"]
    with caplog.at_level(logging.INFO, logger="jgrpo"):
        resumed, resumed_params = _train(load_config(old / "config.yaml", [f"run.output_dir={old}", *overrides]))
    assert any(r.getMessage().startswith("resumed from iteration 2 ") for r in caplog.records)  # not from scratch
    assert json.loads((old / "metrics.jsonl").read_text().splitlines()[0]) == json.loads(
        (PRE_MOVE_RUN / "metrics.jsonl").read_text().splitlines()[0])
    assert resumed.state.iteration == 3 and resumed.state.counters.optimizer_steps == 3
    records = read_metrics(old)
    assert [r["iteration"] for r in records] == [1, 2, 3]  # the old run's two lines kept, one more appended
    assert np.isfinite(records[-1]["loss/loss"]) and records[-1]["loss/grad_norm"] > 0

    new = tmp_path / "straight"
    straight, straight_params = _train(load_config(old / "config.yaml", [f"run.output_dir={new}", *overrides]))
    expected = read_metrics(new)
    # Same data position and rng: iteration 3 draws the same prompts with the same key and samples the same
    # tokens (hence the same rewards and lengths) from params that differ only by float rounding (the old run
    # trained on 2 devices and another machine).
    for key in ("reward/mean", "completion/length_mean", "completion/truncated_frac", "epoch"):
        assert records[-1][key] == expected[-1][key], key
    for key in ("reward/mean", "completion/length_mean"):  # and iterations 1-2 were what this code does too
        # (up to the rounding of a mean over 2 devices' rows instead of 8)
        np.testing.assert_allclose([r[key] for r in records[:2]], [r[key] for r in expected[:2]], rtol=1e-6)
    for a, b in zip(resumed_params, straight_params, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    assert straight.state.counters == resumed.state.counters
