"""The GRPO loop in-process on the tiny random model: on-policy, off-policy with every moving part, NaN handling."""

import jax
import numpy as np
import pytest

from jgrpo.sampling.sampler import Sampler
from jgrpo.training.metrics_log import read_metrics
from jgrpo.training.trainer import Trainer, TrainingDiverged
from tests.helpers import tiny_config

KEY_METRICS = ("reward/mean", "loss/loss", "loss/grad_norm", "entropy/mean", "completion/length_mean",
               "theorem1/tv_theta_alpha", "theorem1/lower_bound", "time/iteration", "throughput/tokens_per_s")


def _copy(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


def _changed(before, after) -> bool:
    return any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True))


def test_on_policy_run_is_finite_changes_params_and_never_recompiles(tmp_path, compile_counter, monkeypatch):
    config = tiny_config(tmp_path, "checkpoint.every=0", "grpo.beta=0.04", "run.max_nonfinite_steps=2",
                     "run.iterations=5")
    trainer = Trainer(config)
    try:
        initial = _copy(trainer.state.params)
        records = [trainer.train_iteration()]
        compile_counter.active = True
        records += [trainer.train_iteration() for _ in range(2)]
        compile_counter.active = False
        assert compile_counter.count == 0, "iterations 2-3 compiled something: shapes or shardings changed"
        for record in records:
            for key in KEY_METRICS:
                assert np.isfinite(record[key]), (key, record[key])
            assert record["theorem1/staleness"] == 0 and "mismatch/logprob_mean" in record
            assert record["mismatch/logprob_max"] < 1e-3  # sampler and trainer log-probs agree (docs/algorithm.md §6)
            assert record["nonfinite/skipped"] == 0
        assert np.isfinite(records[-1]["kl/mean"]) and records[-1]["kl/mean"] > 0  # moved away from the reference
        assert _changed(initial, _copy(trainer.state.params))
        assert trainer.state.counters.optimizer_steps == 3

        # A NaN in the behaviour log-probs makes the loss NaN: the update is skipped (params untouched), logged
        # and counted; max_nonfinite_steps in a row stop the run after a checkpoint.
        real_generate = Sampler.generate

        def nan_generate(self, *args, **kwargs):
            out = real_generate(self, *args, **kwargs)
            return out._replace(logprobs=out.logprobs * np.float32(np.nan))

        monkeypatch.setattr(Sampler, "generate", nan_generate)
        before = _copy(trainer.state.params)
        record = trainer.train_iteration()
        assert record["nonfinite/skipped"] == 1 and record["nonfinite/total"] == 1
        assert not _changed(before, _copy(trainer.state.params))
        with pytest.raises(TrainingDiverged, match="2 optimiser steps in a row"):
            trainer.train_iteration()
        trainer.checkpointer.wait()
        assert trainer.checkpointer.latest_step() == 5
        assert trainer.state.counters.optimizer_steps == 3
    finally:
        trainer.checkpointer.close()
        trainer.close()


def test_off_policy_with_minibatches_micro_batches_and_reference_swap(tmp_path):
    # v=2, i=2, 2 minibatches x 2 micro-batches, recentred ratio (needs lp_k), beta > 0 with a reference
    # swap at the epoch boundary: 8 prompts / batch 4 = 2 iterations per epoch.
    config = tiny_config(tmp_path, "grpo.behaviour_refresh=2", "grpo.inner_steps=2", "grpo.num_minibatches=2",
                     "grpo.micro_batches=2", "grpo.off_policy_ratio=recentred", "grpo.beta=0.1",
                     "grpo.swap_reference=true", "data.num_examples=8", "data.epochs=2", "run.iterations=3",
                     "checkpoint.every=1", "logging.samples_every=2")
    trainer = Trainer(config)
    try:
        assert trainer.steps.lp_k_source == "computed"
        initial = _copy(trainer.state.params)
        assert trainer.run() == "done"
        records = read_metrics(tmp_path)
        assert [r["iteration"] for r in records] == [1, 2, 3]
        assert [r["behaviour_version"] for r in records] == [0, 0, 2]
        assert [r["theorem1/staleness"] for r in records] == [0, 1, 0]
        # The sampler-vs-trainer mismatch is only measurable when the first update runs at the behaviour params.
        assert ["mismatch/logprob_mean" in r for r in records] == [True, False, True]
        assert [r["epoch"] for r in records] == [0, 0, 1]
        assert [r["optim/steps"] for r in records] == [4, 8, 12]
        for record in records:
            for key in KEY_METRICS + ("kl/mean", "theorem1/tv_k_alpha"):
                assert np.isfinite(record[key]), (key, record[key])
        assert records[1]["theorem1/tv_k_alpha"] > 0  # pi_k differs from a stale behaviour policy
        assert _changed(initial, _copy(trainer.state.params))
        assert trainer.state.reference is not None  # swapped at the start of epoch 1
        assert trainer.initial_reference is None  # and the initial params are not kept as a fourth copy
        latest = tmp_path / "checkpoints" / "3"
        assert (latest / "behaviour").is_dir() and (latest / "reference").is_dir()
        assert not (tmp_path / "checkpoints" / "1" / "reference").exists()  # still the initial params then
        samples = [line for line in (tmp_path / "samples.jsonl").read_text().splitlines() if line]
        assert len(samples) == 2 * 4 * 4  # iterations 1 and 2, 4 prompts x G = 4
    finally:
        trainer.close()


def test_greedy_sampling_cannot_train(tmp_path):
    with pytest.raises(ValueError, match="temperature=0"):
        Trainer(tiny_config(tmp_path, "sampler.temperature=0"))


def test_bfloat16_sampling_weights_off_and_on_policy_and_resume(tmp_path):
    # sampler.weights_dtype=bfloat16: the behaviour copy (v = 2) holds the params rounded to bf16 in the
    # sampling layout, is checkpointed and restored as such; on-policy, each iteration samples from a bf16 copy.
    import jax.numpy as jnp

    config = tiny_config(tmp_path, "grpo.behaviour_refresh=2", "sampler.weights_dtype=bfloat16",
                     "model.compute_dtype=bfloat16", "run.iterations=2", "checkpoint.every=1")
    trainer = Trainer(config)
    try:
        initial = _copy(trainer.state.params)
        assert trainer.run() == "done"
        behaviour = trainer.state.behaviour  # refreshed at iteration 0: the initial params, rounded
        for b, p, s in zip(jax.tree.leaves(behaviour), jax.tree.leaves(initial),
                           jax.tree.leaves(trainer.weights.shardings), strict=True):
            assert b.dtype == jnp.bfloat16 and b.sharding == s
            np.testing.assert_array_equal(np.asarray(b), np.asarray(jnp.asarray(p).astype(jnp.bfloat16)))
        saved = _copy(behaviour)
    finally:
        trainer.close()
    resumed = Trainer(tiny_config(tmp_path, "grpo.behaviour_refresh=2", "sampler.weights_dtype=bfloat16",
                              "model.compute_dtype=bfloat16", "run.iterations=3", "checkpoint.every=1"))
    try:
        assert resumed.maybe_resume() and resumed.state.iteration == 2
        for b, s in zip(jax.tree.leaves(resumed.state.behaviour), jax.tree.leaves(saved), strict=True):
            assert b.dtype == jnp.bfloat16
            np.testing.assert_array_equal(np.asarray(b), s)
    finally:
        resumed.close()

    on_policy = Trainer(tiny_config(tmp_path / "v1", "sampler.weights_dtype=bfloat16", "model.compute_dtype=bfloat16",
                                "run.iterations=1", "checkpoint.every=0"))
    try:
        assert on_policy.run() == "done"
        record = read_metrics(tmp_path / "v1")[-1]
        # Sampled from bf16 weights, scored by the float32 params with bf16 matmuls: only norms and embedding
        # rows were rounded, so the two log-probs nearly agree.
        assert np.isfinite(record["loss/loss"]) and abs(record["mismatch/logprob_mean"]) < 0.05
    finally:
        on_policy.close()


def test_off_policy_corrections_end_to_end(tmp_path):
    # CISPO with masked IS, M2PO and sequence masking together at v = 2 with two inner steps: every correction's
    # fraction is logged and finite, and the params move (CISPO keeps a gradient on every token).
    config = tiny_config(tmp_path, "checkpoint.every=0", "run.iterations=2", "grpo.behaviour_refresh=2",
                     "grpo.inner_steps=2", "grpo.policy_loss=cispo", "grpo.masked_is=token",
                     "grpo.masked_is_low=0.9", "grpo.masked_is_high=1.1", "grpo.m2po_tau=0.0001",
                     "grpo.sequence_mask_delta=0.0", "grpo.beta=0.04",
                     # and GDPO over two functions plus the overlong punishment (the tiny model rarely stops)
                     "reward.functions=[tests.helpers:space_fraction,tests.helpers:length_parity]",
                     "reward.weights=[1.0,0.5]", "reward.overlong_buffer=4",
                     "grpo.advantage_reward_normalisation=per_reward")
    trainer = Trainer(config)
    try:
        assert trainer.steps.lp_k_source == "computed"
        initial = _copy(trainer.state.params)
        records = [trainer.train_iteration() for _ in range(2)]
        assert _changed(initial, trainer.state.params)
        for record in records:
            for key in ("loss/mis_drop_frac", "loss/m2po_drop_frac", "loss/sequence_mask_frac", "clip/frac_high",
                        "loss/loss", "kl/mean"):
                assert np.isfinite(record[key]), (key, record[key])
        assert records[1]["loss/m2po_drop_frac"] > 0  # tau 1e-4 at a stale iteration: something is dropped
        for record in records:
            assert -1.0 <= record["reward/overlong"] < 0  # most completions run to max_new_tokens
            assert "reward/overlong/failures" not in record  # a column, not a function
            parts = (record["reward/tests.helpers:space_fraction"]
                     + 0.5 * record["reward/tests.helpers:length_parity"] + record["reward/overlong"])
            np.testing.assert_allclose(record["reward/mean"], parts, rtol=1e-5, atol=1e-6)
    finally:
        trainer.close()
