"""Multi-turn episodes on the slot pool, with the tiny model: trajectories independent of the environments'
latency, log-probs of the sampled tokens exact, appended tokens out of the loss, failures contained."""

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jgrpo.config.loading import load_config
from jgrpo.envs.workers import EnvironmentWorkers
from jgrpo.training.metrics_log import read_metrics
from jgrpo.training.trainer import Trainer
from tests.envs.test_sandbox_escapes import bwrap_problem_or_skip
from tests.helpers import ROOT

TOOLS_YAML = ROOT / "configs" / "tiny_tools.yaml"


@pytest.fixture(autouse=True)
def _importable(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "envs"))  # scripted_envs


def tools_config(run_dir, *overrides):
    return load_config(TOOLS_YAML, [f"run.output_dir={run_dir}", "checkpoint.every=0", "logging.samples_every=0",
                                    *overrides])


def run_to_end(config):
    """A whole run of `config`: (status, its metrics records, the trainer)."""
    trainer = Trainer(config)
    try:
        status = trainer.run()
    finally:
        trainer.close()
    return status, read_metrics(config.run.output_dir), trainer


def play(trainer, batch, key_index=0):
    """One batch's episodes sampled with the trainer's params (the source's path): the Rollout."""
    source = trainer.collector.source
    opened = source._opened(batch)
    prompts = source.prompt_arrays(opened, trainer.state.counters)
    return source.sample(trainer.state.params, opened, prompts, source.sample_key(key_index))


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("scripted")
    trainer = Trainer(tools_config(run_dir, "env.name=tests.envs.scripted_envs:Scripted", "env.num_workers=4",
                                   "env.turn_prefix=", "env.max_turns=4"))
    batch = next(trainer.data)
    yield trainer, batch
    trainer.close()


def test_trajectories_do_not_depend_on_the_environments_latency(scripted, monkeypatch):
    trainer, batch = scripted
    fast = play(trainer, batch)
    assert fast.metrics["env/pauses"] > 0
    monkeypatch.setenv("JGRPO_TEST_LATENCY", "1.5")  # longer than a boundary's work: the host waits at b + 1
    runner = trainer.episodes
    runner.workers.close()
    runner.workers = EnvironmentWorkers(trainer.config)
    try:
        slow = play(trainer, batch)
    finally:
        runner.workers.close()
        monkeypatch.delenv("JGRPO_TEST_LATENCY")
        runner.workers = EnvironmentWorkers(trainer.config)
    assert slow.metrics["env/wait_s"] > fast.metrics["env/wait_s"] + 1.0
    for name in ("tokens", "logprobs", "loss_mask", "lengths", "version"):
        np.testing.assert_array_equal(np.asarray(getattr(slow.samples, name)), np.asarray(getattr(fast.samples, name)),
                                      err_msg=name)
    assert slow.completions == fast.completions


def test_turn_sync_plays_the_same_episodes(scripted, tmp_path):
    trainer, batch = scripted
    pool = play(trainer, batch)
    runner = trainer.episodes
    runner.env = dataclasses.replace(runner.env, schedule="turn_sync")
    try:
        synced = play(trainer, batch)
    finally:
        runner.env = trainer.config.env
    # The same turns and replies; the ring positions differ, so log-probs agree to rounding only.
    np.testing.assert_array_equal(np.asarray(synced.samples.loss_mask), np.asarray(pool.samples.loss_mask))
    np.testing.assert_array_equal(np.asarray(synced.samples.tokens), np.asarray(pool.samples.tokens))
    np.testing.assert_allclose(np.asarray(synced.samples.logprobs), np.asarray(pool.samples.logprobs), atol=1e-4)


def test_paused_episodes_give_their_slots_to_the_next(scripted):
    # Half as many slots as episodes: a paused episode parks, a pending one takes its slot, and it resumes in a
    # free slot with its context prefilled there. The same draws (keys by row and token), log-probs to rounding.
    trainer, batch = scripted
    kept = play(trainer, batch)
    runner = trainer.episodes
    sampler = runner.sampler
    runner.sampler = sampler.replace(slots=len(batch) * trainer.config.grpo.num_generations // 2)
    try:
        handed = play(trainer, batch)
    finally:
        runner.sampler = sampler
    a, b = (jax.device_get(r.samples) for r in (kept, handed))
    np.testing.assert_array_equal(b.tokens, a.tokens)
    np.testing.assert_array_equal(b.loss_mask, a.loss_mask)
    np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-5)


def test_a_turn_that_ends_at_its_first_token_is_answered_too(scripted):
    # Every id a stop id: each turn is one token, and after a reply the next turn ends as it is appended (its
    # first token drawn by the append). The host loop stopped there when no other slot decoded, leaving those
    # episodes unfinished (RuntimeError "episodes did not complete").
    trainer, batch = scripted
    runner = trainer.episodes
    sampler = runner.sampler
    runner.sampler = sampler.replace(stop_ids=tuple(range(trainer.model_config.vocab_size)))
    try:
        rollout = play(trainer, batch)
    finally:
        runner.sampler = sampler
    s = jax.device_get(rollout.samples)
    # Scripted: 3 turns of one drawn token each, two replies between them, reward 0.25 + 0.25 + 1.
    assert (s.loss_mask.sum(axis=1) == 3).all() and (s.completion_mask & ~s.loss_mask).any(axis=1).all()
    assert rollout.metrics["env/turns"] == 3.0 and rollout.metrics["env/pauses"] == 2 * len(s.tokens)
    np.testing.assert_allclose(rollout.rewards[:, 0], 1.5)


def test_evaluation_plays_greedy_episodes(scripted):
    from jgrpo.rollout.evaluator import Evaluator

    trainer, _ = scripted
    config = dataclasses.replace(trainer.config, run=dataclasses.replace(trainer.config.run, eval_samples=0))
    evaluator = Evaluator(config, trainer.sampler, trainer.tokenizer, scorer=trainer.scorer, episodes=trainer.episodes)
    metrics = evaluator.evaluate(trainer.state.params)
    # Scripted: 3 turns, reward 0.25 + 0.25 + 1 >= 1 for every episode that finishes within the token budget.
    assert metrics["prompts"] == config.data.num_test_examples
    assert metrics["greedy_accuracy"] == 1.0
    assert metrics["turns"] == 3.0 and metrics["tool_call_validity"] == 0.0  # no tools, no calls
    # The evaluations during training may look at the first prompts only (whole evaluation batches).
    assert evaluator.evaluate(trainer.state.params, prompts=1)["prompts"] == config.data.batch_size


def test_episode_record(scripted):
    trainer, batch = scripted
    rollout = play(trainer, batch)
    s = jax.device_get(rollout.samples)
    G = trainer.config.grpo.num_generations
    assert s.tokens.shape == (len(batch) * G, trainer.config.env.max_total_tokens)
    appended = s.completion_mask & ~s.loss_mask
    assert appended.any() and s.loss_mask.any()
    assert (s.logprobs[appended] == 0).all() and (s.version[appended] == -1).all()
    assert (s.version[s.loss_mask] == 0).all() and s.valid.all()
    # Scripted: 3 turns, 0.25 for each of the first two, 1 at the end (episodes the budget cut end earlier).
    finished = ~s.truncated
    assert np.allclose(rollout.rewards[finished, 0], 1.5)
    assert rollout.metrics["env/turns"] > 1


def test_recomputed_logprobs_equal_lp_alpha_on_sampled_tokens(scripted):
    trainer, batch = scripted
    rollout = play(trainer, batch)
    source, steps = trainer.collector.source, trainer.steps
    prompts = source.prompt_arrays(rollout.prompts, trainer.state.counters, trainer.mesh)
    assembled, _ = steps.assemble(prompts.tokens, prompts.mask, rollout.samples, jnp.asarray(rollout.rewards))
    lp = np.asarray(steps.passes.pi_k(trainer.state.params, assembled)).reshape(rollout.samples.tokens.shape)
    s = jax.device_get(rollout.samples)
    np.testing.assert_allclose(lp[s.loss_mask], s.logprobs[s.loss_mask], atol=1e-4)


def test_reward_functions_score_the_last_turn_outside_its_tool_calls(tmp_path):
    # tiny_tools' turn prefix opens a calculator call in every turn, so every episode ends by env.max_turns or
    # the token budget with a call in its last turn. The call is not an answer: a number in its arguments (or in
    # one the budget cut off) must not be paid as one, so the reward functions see the text outside the calls.
    config = tools_config(tmp_path, "reward.functions=[tests.envs.scripted_envs:pays_for_any_text]", "env.max_turns=1")
    trainer = Trainer(config)
    try:
        rollout = play(trainer, next(trainer.data))
        specials = trainer.tokenizer.all_special_tokens
    finally:
        trainer.close()
    for completion, reward in zip(rollout.completions, rollout.rewards[:, 0], strict=True):
        after_calls = completion.rsplit("</tool_call>", 1)[1] if "</tool_call>" in completion else ""
        for special in specials:
            after_calls = after_calls.replace(special, "")
        assert reward == float(bool(after_calls.strip())), completion
    assert not rollout.rewards[:, 0].all()  # the calls' text alone is paid nothing


@pytest.mark.parametrize("name, on_failure, iterations", [("Raises", "mask", 2), ("Exits", "zero_reward", 1)])
def test_failing_environments_are_contained_and_the_run_goes_on(tmp_path, name, on_failure, iterations):
    status, records, trainer = run_to_end(tools_config(
        tmp_path, f"env.name=tests.envs.scripted_envs:{name}", "env.num_workers=1", f"env.on_failure={on_failure}",
        f"run.iterations={iterations}", "env.turn_prefix="))
    assert status == "done" and len(records) == iterations
    rows = trainer.config.data.batch_size * trainer.config.grpo.num_generations
    for r in records:
        assert r["env/failed"] == 1.0
        assert r.get("env/failures/step", 0) + r.get("env/failures/worker", 0) == rows
        assert r["reward/mean"] == 0.0


def test_a_python_tool_run_completes_in_the_sandbox(tmp_path):
    # Every turn opens with a whole python call, run under the default sandbox (env.sandbox: auto, bubblewrap where
    # it runs: tests/envs/test_sandbox_escapes.py) by an environment worker: 2 prompts x 4 episodes x 2 turns.
    bwrap_problem_or_skip()
    call = '<tool_call>{"name": "python", "arguments": {"code": "print(6 * 7)"}}</tool_call>'
    status, records, trainer = run_to_end(tools_config(
        tmp_path, "env.tools=[python]", f"env.turn_prefix={call}", "env.max_turns=2", "run.iterations=2"))
    assert status == "done" and len(records) == 2 and trainer.config.env.sandbox == "auto"
    for r in records:
        assert r["env/tool_calls"] == 16 and r["env/failed"] == 0 and r["env/turns"] == 2, r
        assert not any(k.startswith("env/tool_call_errors") for k in r), r


def test_async_at_staleness_0_plays_the_episodes_sync_plays(tmp_path):
    # One-job async: the producer thread opens and plays each batch's episodes. At max_staleness 0 it samples every
    # batch with the params sync samples it with (same keys, same environment seeds): the same episodes, rewards and
    # updates. Its evaluation after each iteration plays episodes on environment workers of its own while the
    # producer plays the next batch's.
    stops = "[" + ",".join(str(i) for i in range(0, 49152, 4)) + "]"  # turns of 1 to ~40 tokens
    common = ("env.name=tests.envs.scripted_envs:Lengths", "env.turn_prefix=", f"sampler.stop_token_ids={stops}",
              "run.iterations=2")
    _, sync, _ = run_to_end(tools_config(tmp_path / "sync", *common))
    _, asyn, trainer = run_to_end(tools_config(tmp_path / "async", *common, "rollout.mode=async",
                                               "rollout.max_staleness=0", "run.eval_every=1"))
    assert trainer.eval_episodes is not trainer.episodes
    assert [r["iteration"] for r in asyn] == [1, 2] and all(r["rollout/staleness"] == 0 for r in asyn)
    assert all(r["eval/turns"] >= 1 for r in asyn)
    for got, want in zip(asyn, sync, strict=True):
        keys = sorted(k for k in want if k.startswith("env/") and k != "env/wait_s")
        assert keys == sorted(k for k in got if k.startswith("env/") and k != "env/wait_s")
        for key in keys + ["reward/mean", "reward/std", "completion/length_mean"]:
            assert got[key] == want[key], (key, got["iteration"])
        np.testing.assert_allclose(got["loss/loss"], want["loss/loss"], rtol=0, atol=1e-6)
    assert any(r["env/turns"] % 1 for r in sync) and all(r["reward/std"] > 0 for r in sync)
