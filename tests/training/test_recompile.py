"""Nothing compiles after the first iteration: iterations 2..5 of configs/tiny.yaml, on- and off-policy.

Iterations 2..5 cover every event of the loop after warm-up: a checkpoint save each, a behaviour refresh (v = 2:
iterations 3 and 5 copy current -> behaviour), reference log-probs (beta > 0) and, off-policy, the recomputed lp_k
and minibatch slicing; with dynamic sampling and adaptive v, extra sampling rounds and a refresh at every
iteration; with continuous batching, slot refills; with `rollout.mode: window`, a window's pool sampled at each
refresh and consumed in between; with `async`, the producer thread's sampling from each published copy; with
`mesh.rollout_devices`, copies and samples crossing between the two sub-meshes. An XLA compilation in that window
means a shape, dtype, sharding or static argument changed between iterations (each costs seconds to minutes on a
real model). The failure message names what compiled (jax_log_compiles). Checkpoints are saved every iteration so
that iteration 1 also runs the save path once: its first call compiles small programs (the checksums of the saved
trees and Orbax's per-device slices), one-time work like iteration 1's own compiles. A mixture of experts with
routing replay is checked in its own training test (tests/training/test_moe_training.py), which runs that model.
"""

import logging

import jax
import pytest

from jgrpo.training.trainer import Trainer
from tests.helpers import EVEN_PARITY_REWARD, tiny_config


@pytest.mark.parametrize("overrides", [
    pytest.param([], id="on_policy"),
    pytest.param(["grpo.behaviour_refresh=2", "grpo.off_policy_ratio=recentred", "grpo.num_minibatches=2"],
                 id="off_policy_v2"),
    # Extra sampling rounds whose batches are rebuilt on the host, and a behaviour copy at every iteration.
    pytest.param(["grpo.dynamic_sampling_rounds=2", EVEN_PARITY_REWARD,
                  "data.epochs=3", "grpo.behaviour_refresh=adaptive", "grpo.refresh_tv=1e-9"],
                 id="dynamic_sampling_adaptive_v"),
    pytest.param(["model.lora.rank=4", "grpo.behaviour_refresh=2", "grpo.beta=0.1", "grpo.swap_reference=true",
                  "data.num_examples=8", "data.epochs=3"], id="lora_v2_reference_swap"),
    # Continuous batching: fewer slots than rows, so slots are refilled inside the sampling program.
    pytest.param(["sampler.slots=4", "grpo.behaviour_refresh=2"], id="continuous_batching_v2"),
    # The behaviour window: iterations 3 and 5 sample the next two iterations' prompts in one pool.
    pytest.param(["rollout.mode=window", "grpo.behaviour_refresh=2"], id="window_v2"),
    # Async rollouts: the producer thread samples with a new published copy at every iteration.
    pytest.param(["rollout.mode=async", "rollout.max_staleness=1"], id="async"),
    # Multi-turn episodes (a random model's tool calls answered with errors of varied lengths): turns pause and
    # resume, appends of any length, behaviour refreshes inside the episodes' iterations.
    pytest.param(["env.name=calculator", "env.turn_prefix=<tool_call>", "env.max_turns=2", "env.max_total_tokens=64",
                  "env.max_append_tokens=40", "env.num_workers=0", "data.max_prompt_length=384",
                  "sampler.prompt_bucket=64", "grpo.behaviour_refresh=2"], id="multi_turn_v2"),
    # The sampler on devices 0-3, the trainer on 4-7: the behaviour copy crosses sub-meshes at each refresh.
    pytest.param(["mesh.rollout_devices=4", "grpo.behaviour_refresh=2"], id="split_placement_v2"),
])
def test_iterations_2_to_5_never_compile(tmp_path, compile_counter, caplog, overrides):
    config = tiny_config(tmp_path, "run.iterations=5", "checkpoint.every=1", *overrides)
    trainer = Trainer(config)
    previous = jax.config.jax_log_compiles
    try:
        trainer.train_iteration()  # iteration 1 compiles everything
        trainer.checkpointer.wait()
        jax.config.update("jax_log_compiles", True)
        compile_counter.count, compile_counter.active = 0, True
        with caplog.at_level(logging.WARNING):
            records = [trainer.train_iteration() for _ in range(4)]  # iterations 2..5
            trainer.checkpointer.wait()
        compile_counter.active = False
        compiled = [r.getMessage()[:160] for r in caplog.records if "Compiling" in r.getMessage()]
        assert compile_counter.count == 0, f"iterations 2-5 compiled {compile_counter.count} programs: {compiled}"
        assert trainer.state.iteration == 5 and trainer.checkpointer.latest_step() == 5
        if config.grpo.behaviour_refresh == 2:
            assert [r["behaviour_version"] for r in records] == [0, 2, 2, 4]  # refreshes inside the window
            assert records[1]["time/weight_sync"] > 0
        if config.grpo.dynamic_sampling_rounds:
            assert sum(r["dynamic/extra_rounds"] for r in records) > 0
            assert all(r["behaviour/refreshed"] == 1 for r in records)
    finally:
        compile_counter.active = False
        jax.config.update("jax_log_compiles", previous)
        trainer.checkpointer.close()
        trainer.close()
