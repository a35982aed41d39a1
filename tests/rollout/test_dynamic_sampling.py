"""DAPO dynamic sampling (`jgrpo.rollout.dynamic_sampling`): which groups fill the batch, and the trainer end to end."""

import dataclasses

import jax
import numpy as np
import pytest

from jgrpo.config import ConfigError, GRPOConfig, MeshConfig
from jgrpo.data import PromptBatch
from jgrpo.parallel.host_arrays import to_global_rows
from jgrpo.parallel.mesh import SAMPLE_RULES, make_mesh
from jgrpo.rewards.scorer import RewardResult
from jgrpo.rollout.dynamic_sampling import fill_batch, groups_with_signal
from jgrpo.rollout.records import Rollout
from jgrpo.sampling.sampler import SampleOutput
from jgrpo.training.metrics_log import read_metrics
from jgrpo.training.trainer import Trainer
from tests.helpers import EVEN_PARITY_REWARD, tiny_config

G = 2  # samples per prompt in the hand-built rounds


def test_groups_with_signal_by_total_or_by_any_reward_column():
    # columns: total, f1, f2. Group 0: total and f1 differ. Group 1: total equal (1 + 0 = 0 + 1) but the
    # columns differ. Group 2: everything equal.
    table = np.array([[1, 1, 0], [0, 0, 0],
                      [1, 1, 0], [1, 0, 1],
                      [2, 1, 1], [2, 1, 1]], np.float32)
    assert groups_with_signal(table, G, per_reward=False).tolist() == [True, False, False]
    assert groups_with_signal(table, G, per_reward=True).tolist() == [True, True, False]


def _round(mesh, tag: int, signal: list[bool]) -> Rollout:
    """A round of len(signal) prompts whose rows are numbered 100 * tag + row (tokens, log-probs, rewards),
    with constant rewards in the groups marked False."""
    B = len(signal)
    rows = np.arange(B * G) + 100 * tag
    rewards = np.array([float(r % 2) if signal[r // G] else 5.0 for r in range(B * G)], np.float32)
    n = 3  # new tokens

    def put(x):
        return to_global_rows(x, mesh, SAMPLE_RULES, B * G)

    output = SampleOutput(tokens=put(np.repeat(rows[:, None], n, 1).astype(np.int32)),
                          logprobs=put(np.repeat(-rows[:, None], n, 1).astype(np.float32)),
                          completion_mask=put(np.ones((B * G, n), bool)), lengths=put(np.full(B * G, n, np.int32)),
                          truncated=put(np.zeros(B * G, bool)), loss_mask=put(np.ones((B * G, n), bool)),
                          version=put(np.zeros((B * G, n), np.int32)))
    scores = RewardResult(total=rewards, per_function={"f": rewards}, failures={"f": tag}, timeouts={"f": 0})
    batch = PromptBatch(token_ids=[[tag, b] for b in range(B)], texts=[f"{tag}.{b}" for b in range(B)],
                        questions=[f"q{tag}.{b}" for b in range(B)], references=[{"tag": tag}] * B, epoch=tag // 2,
                        step=tag)
    return Rollout(batch, output, np.stack([rewards, rewards], axis=1), [f"c{r}" for r in rows], scores, 1.0, 0.5)


def _fill(first, more, rounds, oversample):
    queue = list(more)
    return fill_batch(first, lambda: queue.pop(0) if queue else None, group_size=G, rounds=rounds,
                      oversample=oversample, per_reward=False, mesh=first.samples.tokens.sharding.mesh)


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(MeshConfig(data=2, fsdp=4, tensor=1))


def test_fill_keeps_groups_with_signal_in_order_then_tops_up_with_masked_ones(mesh):
    # 8 prompts (16 rows over 8 devices). Round 0 has signal in groups 0, 2, 5; round 1 in 1, 3, 4, 7; round 2 in
    # 0 .. 7. Two extra rounds allowed: round 1 leaves the batch one short (7 of 8), round 2 fills it.
    first = _round(mesh, 0, [1, 0, 1, 0, 0, 1, 0, 0])
    r1, r2 = _round(mesh, 1, [0, 1, 0, 1, 1, 0, 0, 1]), _round(mesh, 2, [1] * 8)
    filled, metrics = _fill(first, [r1, r2], rounds=2, oversample=1)
    chosen = [(0, 0), (0, 2), (0, 5), (1, 1), (1, 3), (1, 4), (1, 7), (2, 0)]  # (round, group)
    rows = [100 * t + 2 * i + j for t, i in chosen for j in range(G)]
    assert np.asarray(filled.samples.tokens)[:, 0].tolist() == rows
    assert np.asarray(filled.samples.logprobs)[:, 0].tolist() == [-r for r in rows]
    assert filled.completions == [f"c{r}" for r in rows]
    assert filled.prompts.token_ids == [[t, i] for t, i in chosen]
    assert filled.prompts.questions == [f"q{t}.{i}" for t, i in chosen]
    assert filled.prompts.epoch == 1 and filled.prompts.step == 0  # the last drawn batch's epoch; the first's step
    assert filled.scores.failures == {"f": 0 + 1 + 2}  # every reward call counts, kept or not
    assert filled.sample_seconds == 3.0
    assert groups_with_signal(filled.rewards, G, per_reward=False).all()
    assert filled.samples.tokens.sharding == first.samples.tokens.sharding
    assert metrics == {"dynamic/extra_rounds": 2.0, "dynamic/prompts_sampled": 24.0,
                       "dynamic/first_round_signal_frac": 3 / 8, "dynamic/short_groups": 0.0,
                       "dynamic/data_exhausted": 0.0}


def test_fill_stops_when_full_and_tops_up_when_rounds_run_out(mesh):
    first = _round(mesh, 0, [1, 0, 1, 0, 0, 1, 0, 0])
    # Oversample 2: one extra round draws two batches; together they fill the batch, so no second round.
    r1, r2, r3 = _round(mesh, 1, [0, 1, 0, 0, 0, 0, 0, 0]), _round(mesh, 2, [1] * 8), _round(mesh, 3, [1] * 8)
    filled, metrics = _fill(first, [r1, r2, r3], rounds=3, oversample=2)
    assert metrics["dynamic/extra_rounds"] == 1 and metrics["dynamic/prompts_sampled"] == 24
    assert filled.prompts.token_ids == [[0, 0], [0, 2], [0, 5], [1, 1], [2, 0], [2, 1], [2, 2], [2, 3]]
    # Data exhausted after one more batch with one group of signal: 4 of 8, topped up with round 0's first four
    # zero-variance groups (1, 3, 4, 6), which the loss masks; counted.
    filled, metrics = _fill(first, [r1], rounds=3, oversample=1)
    assert filled.prompts.token_ids == [[0, 0], [0, 2], [0, 5], [1, 1], [0, 1], [0, 3], [0, 4], [0, 6]]
    assert metrics["dynamic/short_groups"] == 4 and metrics["dynamic/data_exhausted"] == 1
    assert groups_with_signal(filled.rewards, G, per_reward=False).tolist() == [True] * 4 + [False] * 4
    # A first round with signal everywhere takes no extra round (and rebuilds the same rows).
    full = _round(mesh, 0, [1] * 8)
    filled, metrics = _fill(full, [r2], rounds=2, oversample=1)
    assert metrics["dynamic/extra_rounds"] == 0 and metrics["dynamic/prompts_sampled"] == 8
    assert np.array_equal(np.asarray(filled.samples.tokens), np.asarray(full.samples.tokens))


def test_dynamic_sampling_config_errors():
    with pytest.raises(ConfigError, match="grpo.dynamic_sampling_rounds"):
        GRPOConfig(dynamic_sampling_rounds=-1)
    with pytest.raises(ConfigError, match="grpo.dynamic_sampling_oversample"):
        GRPOConfig(dynamic_sampling_rounds=1, dynamic_sampling_oversample=0)
    with pytest.raises(ConfigError, match="mask_zero_variance"):
        GRPOConfig(dynamic_sampling_rounds=1, mask_zero_variance=False)
    assert dataclasses.replace(GRPOConfig(), dynamic_sampling_rounds=2).dynamic_sampling_rounds == 2


def _run(run_dir, iterations, *overrides):
    config = tiny_config(
        run_dir, f"run.iterations={iterations}", "checkpoint.every=1", "logging.samples_every=0",
        "grpo.dynamic_sampling_rounds=2", "grpo.beta=0.0", "optim.learning_rate=1e-2", "data.batch_size=8",
        "data.epochs=4", *overrides, reward=EVEN_PARITY_REWARD)
    trainer = Trainer(config)
    try:
        status = trainer.run()
        params = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(trainer.state.params))]
        return status, params, trainer.state.data_state
    finally:
        trainer.close()


def test_dynamic_sampling_trains_on_groups_with_signal_and_resumes_exactly(tmp_path):
    # About half of the prompts (odd answers) score 0 for every sample: their groups have no signal. Extra rounds
    # replace them; a run resumed after iteration 2 draws the same extra batches and ends bit-equal.
    _, straight, straight_data = _run(tmp_path / "straight", 4)
    records = [r for r in read_metrics(tmp_path / "straight") if "dynamic/extra_rounds" in r]
    assert len(records) == 4
    assert all(r["dynamic/extra_rounds"] >= 1 for r in records)
    assert all(r["dynamic/first_round_signal_frac"] < 1 for r in records)
    for r in records:  # every group in the loss has signal, unless the rounds ran out (then counted)
        assert r["loss/zero_variance_frac"] == pytest.approx(r["dynamic/short_groups"] / 8)
    assert sum(r["dynamic/prompts_sampled"] for r in records) > 4 * 8  # it drew extra batches
    _run(tmp_path / "resumed", 2)
    _, resumed, resumed_data = _run(tmp_path / "resumed", 4)
    assert resumed_data == straight_data
    assert all(np.array_equal(a, b) for a, b in zip(straight, resumed, strict=True))
    resumed_records = [r for r in read_metrics(tmp_path / "resumed") if "dynamic/extra_rounds" in r]
    assert [r["dynamic/prompts_sampled"] for r in resumed_records[-2:]] == [
        r["dynamic/prompts_sampled"] for r in records[-2:]]


def test_dynamic_sampling_stops_cleanly_when_the_data_runs_out(tmp_path):
    # 16 prompts, batch 8, one epoch: 2 batches. Iteration 1 draws both (the first round has groups without
    # signal); iteration 2 finds no data: the run stops, saved, instead of failing.
    status, _, _ = _run(tmp_path / "short", 5, "data.num_examples=16", "data.epochs=1")
    assert status == "done"
    records = [r for r in read_metrics(tmp_path / "short") if "dynamic/extra_rounds" in r]
    assert len(records) == 1 and records[0]["dynamic/prompts_sampled"] == 16
    assert (tmp_path / "short" / "checkpoints").exists()
