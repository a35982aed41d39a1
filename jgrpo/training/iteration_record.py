"""The metrics record of one training iteration, from device arrays, loss accumulators and timings.

Batch statistics (rewards, accuracy, lengths) are reduced on device over the *global* arrays, so every
process computes the same numbers; only process 0 writes them. Names group into TensorBoard sections:

    reward/mean, reward/std, reward/<fn>, reward/<fn>/std, reward/<fn>/failures, reward/<fn>/timeouts
    accuracy                  fraction of completions the first reward function scores >= 1 (correct)
    completion/*              length_mean / length_min / length_max, truncated_frac
    sampler/preempted         rows the sampler preempted for lack of pages and drew again (`sampler.kv_pages`)
    kl/mean, entropy/mean     per token, over the loss tokens / all completion tokens
    clip/*                    frac_low, frac_high, frac_dual
    theorem1/*                tv_theta_alpha, tv_k_alpha, tv_weight_mean, tv_weight_M, surrogate_alpha,
                              lower_bound (docs/algorithm.md §7), and staleness = k - version(behaviour)
    mismatch/*                |sampler - trainer| log-prob gap at the behaviour params (docs/algorithm.md §6), and the
                              fraction of sampled tokens outside the trainer's truncated support; logged on
                              iterations whose first update runs at the behaviour params (every one when v = 1,
                              each refresh when v > 1)
    moe/*                     a mixture of experts: routing_mismatch (share of top-k sets the trainer's router
                              picks differently from the sampler's, when mismatch/* is logged), lp_mismatch (=
                              mismatch/logprob_mean), expert_load_max (`rl.routing_replay`), aux_loss and z_loss
                              (the router losses, added to the loss with `model.router_*_loss_coef` > 0)
    loss/*                    loss, pg_loss, kl_loss, ratio_*, advantage_*, zero_variance_frac, grad_norm, ...,
                              empty_steps (updates with nothing in the loss)
    dynamic/*                 DAPO dynamic sampling (docs/algorithm.md §15): extra_rounds, prompts_sampled,
                              first_round_signal_frac, short_groups (masked zero-variance groups left), data_exhausted
    behaviour/*               refreshed (this iteration sampled from a fresh behaviour copy), refreshes (the run's)
    optim/*                   lr (first update of the iteration), lr_last (last one), steps
    time/*, throughput/*      seconds per phase; generated tokens/s overall and while sampling; trained tokens/s
                              (real prompt tokens once per group + generated tokens, per inner step)
Loss metrics are means over the iteration's optimiser steps (extremes, `*_min` / `*_max`, their min / max); a
mean over an empty set (e.g. the KL when every group is masked) is absent, never NaN. TV(pi_k, alpha) is
averaged over the updates where lp_k is the real pi_k (`lp_k_exact`), and the lower bound uses that value.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jgrpo.parallel.host_arrays import fetch, global_sum
from jgrpo.rl.diagnostics import MEAN_COUNTS, extreme_kind

log = logging.getLogger("jgrpo.training.trainer")  # the trainer's log: these lines are its warnings

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
    "outside_support_frac": "mismatch/outside_support_frac",
    "routing_mismatch": "moe/routing_mismatch",
    "routing_count": "moe/routing_count",
    "expert_load_max": "moe/expert_load_max",
    "router_aux_loss": "moe/aux_loss",
    "router_z_loss": "moe/z_loss",
    "packing_fill": "packing/fill",
    "packing_prompt_fill": "packing/prompt_fill",
    "packing_micro_batches": "packing/micro_batches",
    "packing_micro_batches_max": "packing/micro_batches_max",
    "packing_rows_computed": "packing/rows_computed",
}
_FIRST_UPDATE_ONLY = ("logprob_mismatch_mean", "logprob_mismatch_max", "mismatch_token_count", "outside_support_frac",
                      "routing_mismatch", "routing_count")
_STEP_FLAGS = ("empty", "lp_k_exact")  # read by the trainer and below, not logged as loss/*


@jax.jit
def _batch_stats(reward_table, lengths, truncated, prompt_mask):
    """reward_table [R, 1+F] (total, then each function), lengths [R], truncated [R], prompt_mask [B, P] ->
    scalar statistics."""
    lengths = lengths.astype(jnp.float32)
    return {
        "prompt_tokens": prompt_mask.astype(jnp.float32).sum(),
        "mean": reward_table.mean(axis=0),  # [1+F]
        "std": reward_table.std(axis=0),  # [1+F]
        "accuracy": (reward_table[:, 1] >= 1.0).mean() if reward_table.shape[1] > 1 else jnp.float32(jnp.nan),
        "length_mean": lengths.mean(),
        "length_min": lengths.min(),
        "length_max": lengths.max(),
        "generated_tokens": lengths.sum(),
        "truncated_frac": truncated.astype(jnp.float32).mean(),
    }


def _update_means(update_metrics: list[dict], behaviour_is_current: bool) -> dict:
    """The loss metrics of the iteration's updates, one value per key (see the module doc)."""
    record = {}
    for key in update_metrics[0]:
        if key in _STEP_FLAGS:
            continue
        updates = update_metrics[:1] if key in _FIRST_UPDATE_ONLY else update_metrics
        if key in _FIRST_UPDATE_ONLY and not behaviour_is_current:
            continue
        if key == "tv_k_alpha":
            updates = [m for m in updates if m["lp_k_exact"] > 0]
        if key in MEAN_COUNTS:  # a mean over an empty set is no value at all
            updates = [m for m in updates if m[MEAN_COUNTS[key]] > 0]
        if not updates:
            continue
        values = np.asarray([float(m[key]) for m in updates])
        if not np.isfinite(values).any():
            value = float(values[0])
        else:  # an extreme stays one over the iteration's updates; anything else is their mean
            value = float({"min": np.nanmin, "max": np.nanmax, None: np.nanmean}[extreme_kind(key)](values))
        record[_SECTIONS.get(key, f"loss/{key}")] = value
    if "theorem1/tv_k_alpha" in record and "theorem1/lower_bound" in record:
        # Each update's bound used its own lp_k; put the real TV(pi_k, alpha) in: L - 2 M TV - 2 TV_k.
        bounded = [m for m in update_metrics if m["bound_row_count"] > 0]
        without_tv_k = np.mean([float(m["lower_bound"]) + 2 * float(m["tv_k_alpha"]) for m in bounded])
        record["theorem1/lower_bound"] = float(without_tv_k - 2 * record["theorem1/tv_k_alpha"])
    if "moe/routing_mismatch" in record and "mismatch/logprob_mean" in record:
        record["moe/lp_mismatch"] = record["mismatch/logprob_mean"]  # beside the routing it comes from
    return record


class IterationFacts(NamedTuple):
    """What the loop knows of an iteration besides its samples and updates."""

    reward_names: tuple[str, ...]  # the reward table's columns after the total
    timings: dict  # seconds per phase
    staleness: int  # k - version(behaviour)
    behaviour_is_current: bool  # the first update ran at the behaviour params (mismatch metrics are meaningful)
    lr: float  # of the first update
    lr_last: float  # of the last one
    inner_steps: int


def iteration_metrics(rollout, update_metrics: list[dict], facts: IterationFacts, reward_table, prompt_mask) -> dict:
    """The record of one iteration: `rollout` (its samples: global arrays; its scores: this process's rows),
    the finalised `update_metrics`, the global `reward_table` [R, 1 + F] and `prompt_mask` [B, P]."""
    out, result, timings = rollout.samples, rollout.scores, facts.timings
    reward_names, inner_steps = facts.reward_names, facts.inner_steps
    stats = fetch(_batch_stats(reward_table, out.lengths, out.truncated, prompt_mask))
    record = {"reward/mean": float(stats["mean"][0]), "reward/std": float(stats["std"][0])}
    functions = [n for n in reward_names if n in result.failures]  # (not the overlong punishment's column)
    failures = global_sum(np.asarray([result.failures[n] for n in functions] +
                                     [result.timeouts[n] for n in functions], np.int64))
    for i, name in enumerate(reward_names):
        record[f"reward/{name}"] = float(stats["mean"][i + 1])
        record[f"reward/{name}/std"] = float(stats["std"][i + 1])
    for i, name in enumerate(functions):
        record[f"reward/{name}/failures"] = int(failures[i])
        record[f"reward/{name}/timeouts"] = int(failures[len(functions) + i])
    record["accuracy"] = float(stats["accuracy"])
    for key in ("length_mean", "length_min", "length_max", "truncated_frac"):
        record[f"completion/{key}"] = float(stats[key])
    if out.preempted is not None:  # rows the sampler preempted for lack of pages and drew again (sampler.kv_pages)
        record["sampler/preempted"] = int(fetch(jnp.sum(out.preempted)))

    record.update(_update_means(update_metrics, facts.behaviour_is_current))
    record["theorem1/staleness"] = facts.staleness
    record["optim/lr"] = facts.lr
    record["optim/lr_last"] = facts.lr_last

    for phase, seconds in timings.items():
        record[f"time/{phase}"] = seconds
    generated = float(stats["generated_tokens"])
    record["throughput/tokens_per_s"] = generated / max(timings["iteration"], 1e-9)
    record["throughput/sample_tokens_per_s"] = generated / max(timings["sample"], 1e-9)
    # Useful tokens: each real prompt token once per group (the trainer computes it once for its G samples),
    # each generated token once; no padding. Every inner step passes over all of them.
    trained = inner_steps * (float(stats["prompt_tokens"]) + generated)
    record["throughput/train_tokens_per_s"] = trained / max(timings["update"], 1e-9)
    return record


def sample_dump(rollout, generations: int, max_prompts: int = 4) -> list[dict]:
    """Rows for samples.jsonl: the first `max_prompts` local prompts with all their completions and rewards."""
    batch, completions, result = rollout.prompts, rollout.completions, rollout.scores
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


def count_updates(counters, update_metrics: list[dict], *, skip_empty: bool, iteration: int) -> tuple[int, int]:
    """Count an iteration's updates into the run's counters (`checkpoint.RunCounters`); returns (non-finite,
    empty) updates. A non-finite update was skipped; an empty one (nothing in the loss) was skipped with
    `optim.skip_empty_steps`, else applied; every other update is an optimiser step."""
    skipped = empty = 0
    for m in update_metrics:
        if m["nonfinite"] > 0:
            skipped += 1
            counters.nonfinite_in_a_row += 1
            counters.nonfinite_total += 1
            log.warning("iteration %d: non-finite loss (%s) or gradient norm (%s): update skipped",
                        iteration, m["loss"], m["grad_norm"])
            continue
        counters.nonfinite_in_a_row = 0
        if m["empty"] > 0:
            empty += 1
            counters.empty_steps += 1
            if skip_empty:
                continue
        counters.optimizer_steps += 1
    return skipped, empty

