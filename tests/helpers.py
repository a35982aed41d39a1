"""What many tests share: the tiny config builder, test rewards, a compile counter, reference attention.

Imported as `from tests.helpers import ...` (the repository root is on sys.path: pytest's `pythonpath`, and the
current directory of the subprocesses tests start). The rewards are imported by path in reward worker
processes ("tests.helpers:space_fraction"), so this module imports nothing heavy at the top.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTDATA = ROOT / "tests" / "testdata"
TINY_YAML = ROOT / "configs" / "tiny.yaml"

SPACE_REWARD = "reward.functions=[tests.helpers:space_fraction]"
PARITY_REWARD = "reward.functions=[tests.helpers:length_parity]"
EVEN_PARITY_REWARD = "reward.functions=[tests.helpers:parity_on_even_answers]"
QUIET = ["checkpoint.every=0", "logging.samples_every=0"]  # no checkpoint writes, no sample dumps


def child_xla_flags(devices: int) -> str:
    """XLA_FLAGS for a process a test starts: `devices` CPU devices, and otherwise the suite's flags (tests/conftest.py:
    XLA:CPU's LLVM passes off, ~30% of a compile). Children with the same flags share the suite's compilation
    cache; a child at other flags would compile every program again, and more slowly."""
    import os

    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device")]
    return " ".join([*kept, f"--xla_force_host_platform_device_count={devices}"])


def tiny_config(run_dir=None, *overrides: str, reward: str | None = SPACE_REWARD):
    """configs/tiny.yaml (a tiny random Llama on 1-digit addition) for a run in `run_dir`, scored by `reward`
    (a `reward.functions=[...]` override; None keeps tiny.yaml's), then `overrides`."""
    from jgrpo.config.loading import load_config

    head = ([f"run.output_dir={run_dir}"] if run_dir is not None else []) + ([reward] if reward else [])
    return load_config(TINY_YAML, [*head, *overrides])


# ------------------------------------------------------------------ rewards a tiny random model can learn


def space_fraction(prompt: str, completion: str, reference: dict) -> float:
    """Fraction of the completion's characters that are spaces; 0 for an empty completion.

    Random text from a random model scores ~0.1-0.2 with real spread inside a group (GRPO needs variance),
    and a policy can push it up just by preferring space-led tokens: trivially learnable.
    """
    return completion.count(" ") / len(completion) if completion else 0.0


def length_parity(prompt: str, completion: str, reference: dict) -> float:
    """1 when the completion has an odd number of characters: random text gives real variance in every group."""
    return float(len(completion) % 2)


def parity_on_even_answers(prompt: str, completion: str, reference: dict) -> float:
    """`length_parity` where the reference answer is even, 0 elsewhere: about half the groups have no variance."""
    return float(len(completion) % 2) if int(reference["answer"]) % 2 == 0 else 0.0


# ------------------------------------------------------------------ compiles


class CompileCounter:
    """Counts XLA compilations (backend compiles, persistent-cache hits included) while active."""

    def __init__(self):
        import jax

        self.count = 0
        self.active = False
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event, duration, **kwargs):
        if self.active and event == "/jax/core/compile/backend_compile_duration":
            self.count += 1


# ------------------------------------------------------------------ attention by the formula


def reference_attention(q, k, v, allowed):
    """softmax(q k^T / sqrt(d)) v, written out, masked by `allowed`: q [B, T, H, D], k/v [B, S, K, D] (K divides H),
    allowed [B, T, S] bool; a query with nothing allowed gets the mean of v. The formula every attention
    implementation is tested against."""
    import jax
    import jax.numpy as jnp

    B, T, H, Dh = q.shape
    KVH = k.shape[2]
    q = q.reshape(B, T, KVH, H // KVH, Dh)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k) * Dh**-0.5
    scores = jnp.where(allowed[:, None, None], scores, jnp.finfo(jnp.float32).min)
    out = jnp.einsum("bkgts,bskd->btkgd", jax.nn.softmax(scores, axis=-1), v)
    return out.reshape(B, T, H, Dh)


# ------------------------------------------------------------------ sampling in one call


def generate(graphdef, params, tokens, mask, *, key, prompt_index=None, **options):
    """`Sampler(graphdef, **options).generate(params, Prompts(tokens, mask, prompt_index), key)`: the sampler's
    completions of left-padded prompts, with its options (max_new_tokens, method, num_samples, stop_ids, ...)."""
    from jgrpo.sampling.sampler import Prompts, Sampler

    return Sampler(graphdef, **options).generate(params, Prompts(tokens, mask, prompt_index), key)


def sampled(tokens, completion_mask, logprobs, truncated=None):
    """A sampler record (`SampleOutput`) of given rows: every real token drawn, by version 0."""
    import jax.numpy as jnp

    from jgrpo.sampling.state import SampleOutput

    completion_mask = jnp.asarray(completion_mask, bool)
    truncated = jnp.zeros(completion_mask.shape[0], bool) if truncated is None else jnp.asarray(truncated, bool)
    return SampleOutput(tokens=jnp.asarray(tokens, jnp.int32), logprobs=jnp.asarray(logprobs, jnp.float32),
                        completion_mask=completion_mask, lengths=completion_mask.sum(-1, dtype=jnp.int32),
                        truncated=truncated, loss_mask=completion_mask,
                        version=jnp.where(completion_mask, 0, -1).astype(jnp.int32))


def assert_resume_is_bit_exact(run_dir: Path, last_step: int, config_for, state_of, straight) -> None:
    """Copy the finished run `run_dir` beside it without its last checkpoint (the directory as it was one
    iteration earlier), run `config_for(copy)` there to the end (a resume), and check `state_of(trainer)` equals
    `straight` bit for bit, dtypes included."""
    import shutil

    import jax
    import numpy as np

    from jgrpo.training.trainer import Trainer

    resumed_dir = run_dir.with_name(run_dir.name + "_resumed")
    shutil.copytree(run_dir, resumed_dir)
    shutil.rmtree(resumed_dir / "checkpoints" / str(last_step))
    trainer = Trainer(config_for(resumed_dir))
    try:
        assert trainer.run() == "done"
        resumed = state_of(trainer)
    finally:
        trainer.close()
    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)

