"""GRPO sampling from an int8 copy of the policy (`sampler.weights_dtype: int8`, models/quantize.py) with an int8
KV cache (`sampler.kv_cache_dtype: int8`, models/kv_quant.py) on the tiny model: the behaviour copy (v = 4) is int8
values and scales, checkpointed as such, so a resume samples from the same weights bit for bit; nothing recompiles
after iteration 1; the sampler/trainer mismatch is measured; the missing-correction warning is shown once, and not
with a correction; LoRA, window and async modes run."""

import logging

import jax
import numpy as np
import pytest

from jgrpo.training.trainer import Trainer
from tests.helpers import QUIET, assert_resume_is_bit_exact, tiny_config

INT8 = ("sampler.weights_dtype=int8", "sampler.kv_cache_dtype=int8")
INT8_V4 = (*INT8, "grpo.behaviour_refresh=4", "run.iterations=3", "checkpoint.every=1",
           "checkpoint.keep=3")
WARNING = "sampler.weights_dtype=int8 and sampler.kv_cache_dtype=int8 samples from a quantized policy"


def _state(trainer):
    s = trainer.state
    return jax.tree.map(np.asarray, jax.device_get((s.params, s.opt_state, s.behaviour)))


def test_an_int8_behaviour_copy_samples_trains_never_recompiles_and_resumes_bit_for_bit(tmp_path, compile_counter,
                                                                                        caplog):
    with caplog.at_level(logging.WARNING):
        trainer = Trainer(tiny_config(tmp_path / "straight", *QUIET, *INT8_V4))
    assert sum(WARNING in r.getMessage() for r in caplog.records) == 1
    try:
        first = trainer.train_iteration()  # compiles
        behaviour = trainer.state.behaviour["layers"]
        assert behaviour["q"].dtype == np.int8 and behaviour["q_scale"].dtype == np.float32
        assert behaviour["attn_norm"].dtype == np.float32  # model.compute_dtype
        trainer.checkpointer.wait()
        compile_counter.count, compile_counter.active = 0, True
        later = [trainer.train_iteration() for _ in range(2)]
        trainer.checkpointer.wait()
        compile_counter.active = False
        assert compile_counter.count == 0, f"iterations 2-3 compiled {compile_counter.count} programs"
        straight = _state(trainer)
    finally:
        compile_counter.active = False
        trainer.close()
    for record in (first, *later):
        assert all(np.isfinite(v) for v in record.values() if isinstance(v, float)), record
    # The int8 copy, made at iteration 1 (v = 4), is timed as time/quantize within time/weight_sync.
    assert 0 < first["time/quantize"] <= first["time/weight_sync"]
    assert all("time/quantize" not in r for r in later)
    # Iteration 1 samples from the int8 copy of the current params: the trainer's float32 forward differs from
    # lp_alpha by the quantization alone (float32 sampling: below 1e-5, tests/models/test_quantize.py).
    assert first["mismatch/logprob_mean"] > 1e-4
    # Resumed from iteration 2's checkpoint (its int8 behaviour copy restored as values and scales): iteration 3
    # again, the same bits.
    assert_resume_is_bit_exact(tmp_path / "straight", 3, lambda d: tiny_config(d, *QUIET, *INT8_V4), _state,
                               straight)


@pytest.mark.parametrize("overrides", [
    pytest.param(["model.lora.rank=4", "rollout.mode=window", "grpo.behaviour_refresh=2", "grpo.masked_is=token"],
                 id="lora_window_corrected"),
    pytest.param(["rollout.mode=async", "rollout.max_staleness=1", "grpo.off_policy_ratio=current",
                  "grpo.truncated_is=token"], id="async_corrected"),
])
def test_int8_sampling_in_every_mode(tmp_path, caplog, overrides):
    with caplog.at_level(logging.WARNING):
        trainer = Trainer(tiny_config(tmp_path, *QUIET, *INT8, "run.iterations=2",
                                      "checkpoint.every=0", *overrides))
    assert not any(WARNING in r.getMessage() for r in caplog.records)  # a correction is set
    try:
        if trainer.frozen.lora:  # the frozen base is quantized once; the adapters stay float
            assert trainer.frozen.sample["layers"]["q"].dtype == np.int8
        records = [trainer.train_iteration() for _ in range(2)]
    finally:
        trainer.close()
    for record in records:
        assert all(np.isfinite(v) for v in record.values() if isinstance(v, float)), record
    assert records[0]["mismatch/logprob_mean"] > 1e-4
