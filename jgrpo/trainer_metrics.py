"""The metrics record of one training iteration, from device arrays, loss accumulators and timings.

Batch statistics (rewards, accuracy, lengths) are reduced on device over the *global* arrays, so every
process computes the same numbers; only process 0 writes them. Names group into TensorBoard sections:

    reward/mean, reward/std, reward/<fn>, reward/<fn>/std, reward/<fn>/failures, reward/<fn>/timeouts
    accuracy                  fraction of completions the first reward function scores >= 1 (correct)
    completion/*              length_mean / length_min / length_max, truncated_frac
    kl/mean, entropy/mean     per token, over the loss tokens / all completion tokens
    clip/*                    frac_low, frac_high, frac_dual
    theorem1/*                tv_theta_alpha, tv_k_alpha, tv_weight_mean, tv_weight_M, surrogate_alpha,
                              lower_bound (GRPO_SPEC §7), and staleness = k - version(behaviour)
    mismatch/*                |sampler - trainer| log-prob gap at the behaviour params (spec §6); logged on
                              iterations whose first update runs at the behaviour params (every one when v = 1,
                              each refresh when v > 1)
    loss/*                    loss, pg_loss, kl_loss, ratio_*, advantage_*, zero_variance_frac, grad_norm, ...
    time/*, throughput/*      seconds per phase; generated tokens/s overall and while sampling, trained tokens/s
Loss metrics are means over the iteration's optimiser steps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jgrpo.host_arrays import global_sum

_SECTIONS = {
    "kl_mean": "kl/mean",
    "entropy_mean": "entropy/mean",
    "clip_frac_low": "clip/frac_low",
    "clip_frac_high": "clip/frac_high",
    "clip_frac_dual": "clip/frac_dual",
    "tv_theta_alpha": "theorem1/tv_theta_alpha",
    "tv_k_alpha": "theorem1/tv_k_alpha",
    "tv_weight_mean": "theorem1/tv_weight_mean",
    "tv_weight_M": "theorem1/tv_weight_M",
    "surrogate_alpha": "theorem1/surrogate_alpha",
    "lower_bound": "theorem1/lower_bound",
    "logprob_mismatch_mean": "mismatch/logprob_mean",
    "logprob_mismatch_max": "mismatch/logprob_max",
}
_FIRST_UPDATE_ONLY = ("logprob_mismatch_mean", "logprob_mismatch_max")


@jax.jit
def _batch_stats(reward_table, lengths, truncated):
    """reward_table [R, 1+F] (total, then each function), lengths [R], truncated [R] -> scalar statistics."""
    lengths = lengths.astype(jnp.float32)
    return {
        "mean": reward_table.mean(axis=0),  # [1+F]
        "std": reward_table.std(axis=0),  # [1+F]
        "accuracy": (reward_table[:, 1] >= 1.0).mean() if reward_table.shape[1] > 1 else jnp.float32(jnp.nan),
        "length_mean": lengths.mean(),
        "length_min": lengths.min(),
        "length_max": lengths.max(),
        "generated_tokens": lengths.sum(),
        "truncated_frac": truncated.astype(jnp.float32).mean(),
    }


def iteration_metrics(*, update_metrics: list[dict], reward_table, reward_names, result, out, timings: dict,
                      staleness: int, behaviour_is_current: bool, lr: float, trained_tokens: int) -> dict:
    stats = jax.device_get(_batch_stats(reward_table, out.lengths, out.truncated))
    record = {"reward/mean": float(stats["mean"][0]), "reward/std": float(stats["std"][0])}
    failures = global_sum(np.asarray([result.failures[n] for n in reward_names] +
                                     [result.timeouts[n] for n in reward_names], np.int64))
    for i, name in enumerate(reward_names):
        record[f"reward/{name}"] = float(stats["mean"][i + 1])
        record[f"reward/{name}/std"] = float(stats["std"][i + 1])
        record[f"reward/{name}/failures"] = int(failures[i])
        record[f"reward/{name}/timeouts"] = int(failures[len(reward_names) + i])
    record["accuracy"] = float(stats["accuracy"])
    for key in ("length_mean", "length_min", "length_max", "truncated_frac"):
        record[f"completion/{key}"] = float(stats[key])

    for key in update_metrics[0]:
        if key in _FIRST_UPDATE_ONLY:
            if not behaviour_is_current:
                continue
            value = float(update_metrics[0][key])
        else:
            values = np.asarray([float(m[key]) for m in update_metrics])
            value = float(np.nanmean(values)) if np.isfinite(values).any() else float(values[0])
        record[_SECTIONS.get(key, f"loss/{key}")] = value
    record["theorem1/staleness"] = staleness
    record["optim/lr"] = lr

    for phase, seconds in timings.items():
        record[f"time/{phase}"] = seconds
    generated = float(stats["generated_tokens"])
    record["throughput/tokens_per_s"] = generated / max(timings["iteration"], 1e-9)
    record["throughput/sample_tokens_per_s"] = generated / max(timings["sample"], 1e-9)
    record["throughput/train_tokens_per_s"] = trained_tokens * len(update_metrics) / max(timings["update"], 1e-9)
    return record


def sample_dump(batch, completions: list[str], result, generations: int, max_prompts: int = 4) -> list[dict]:
    """Rows for samples.jsonl: the first `max_prompts` local prompts with all their completions and rewards."""
    rows = []
    for b in range(min(len(batch), max_prompts)):
        for j in range(generations):
            i = b * generations + j
            rows.append({
                "prompt": batch.texts[b],
                "answer": batch.references[b].get("answer"),
                "completion": completions[i],
                "reward": float(result.total[i]),
                **{f"reward/{name}": float(values[i]) for name, values in result.per_function.items()},
            })
    return rows
