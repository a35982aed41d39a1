"""The planner lowers the programs the trainer runs: the same names, with the same input shapes and dtypes.

A real run of the tiny config with every program in play (v = 2: the behaviour copy; beta > 0: the reference;
the recentred ratio: pi_k's log-probs; M2PO's mask; inner steps x minibatches: the shuffle; held-out greedy
evaluation) records each program it calls; `lower_iteration` lowers the same config over the same 8 devices.
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np

import jgrpo.sampling.sampler as sampler_module
from jgrpo.planning.abstract_run import lower_iteration
from jgrpo.training.programs import iteration_programs
from jgrpo.training.trainer import Trainer
from tests.helpers import tiny_config

EVERY_PROGRAM = ["grpo.behaviour_refresh=2", "grpo.beta=0.04", "grpo.off_policy_ratio=recentred",
                 "grpo.m2po_tau=0.05", "grpo.inner_steps=2", "grpo.num_minibatches=2", "run.eval_every=1",
                 "run.eval_samples=0", "run.iterations=2", "checkpoint.every=0", "logging.samples_every=0",
                 # the width the planner plans for (its worst case) is the one the prompts are padded to here
                 "data.max_prompt_length=32", "sampler.prompt_bucket=32"]


def _signature(args) -> list[tuple]:
    """The (shape, dtype) of every array among `args`, in a canonical order."""
    leaves = [x for x in jax.tree.leaves(args) if hasattr(x, "shape") and hasattr(x, "dtype")]
    return sorted((tuple(x.shape), str(jnp.dtype(x.dtype)) if not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
                   else "key") for x in leaves)


def _record(calls: dict, name: str, fn):
    def recorded(*args, **kwargs):
        calls.setdefault(name, set()).add(tuple(_signature((args, kwargs))))
        return fn(*args, **kwargs)

    return recorded


def test_the_planner_lowers_exactly_the_programs_a_real_run_calls(tmp_path, devices, monkeypatch):
    config = tiny_config(tmp_path, *EVERY_PROGRAM)
    assert iteration_programs(config) == ("sample", "assemble", "ref_logprobs", "lp_k", "m2po_mask", "shuffle",
                                          "update", "behaviour", "eval")
    calls: dict[str, set] = {}
    sample = sampler_module.sample

    def sample_or_eval(graphdef, params, prompts, key, version, *, spec):  # held-out evaluation samples greedily
        name = "eval" if spec.method.temperature == 0 else "sample"
        calls.setdefault(name, set()).add(tuple(_signature((params, prompts, key, version))))
        return sample(graphdef, params, prompts, key, version, spec=spec)

    sample_or_eval.lower = sample.lower  # the planner lowers the program itself
    monkeypatch.setattr(sampler_module, "sample", sample_or_eval)
    trainer = Trainer(config)
    steps = trainer.steps
    for name, part, attribute in (("assemble", steps, "assemble"), ("ref_logprobs", steps.passes, "reference"),
                                  ("lp_k", steps.passes, "pi_k"), ("m2po_mask", steps.passes, "m2po_mask"),
                                  ("shuffle", steps.updates, "shuffle"), ("update", steps.updates, "step")):
        setattr(part, attribute, _record(calls, name, getattr(part, attribute)))
    trainer.weights.copy = _record(calls, "behaviour", trainer.weights.copy)
    try:
        assert trainer.run() == "done"
    finally:
        trainer.close()

    planned = {p.name: tuple(_signature(p.lowered.args_info)) for p in lower_iteration(config, devices).programs}
    assert sorted(calls) == sorted(planned)
    for name, signatures in calls.items():  # every call of the run had the planner's input shapes
        want = collections.Counter(planned[name])
        got = [collections.Counter(s) for s in signatures]
        differ = [(g - want, want - g) for g in got if g != want]
        assert not differ, (name, differ)
    assert np.isfinite(trainer.state.counters.optimizer_steps)
