"""Held-out evaluation of any params on the test split: greedy accuracy, and over n = `run.eval_samples` samples
per prompt pass@k (the unbiased estimator) and maj@k (majority vote of the first k samples' answers) for each k
of `run.eval_k` (default 1 and n); the mean completion length and the share of completions cut by the token
budget, greedy and sampled. With an environment, of episodes, with their turns and tool-call validity (no maj@k:
an episode's answer is its last turn).

With `run.eval_group_by` (a field of the test rows' references, e.g. the word problems' `held_out`) greedy
accuracy, pass@k and maj@k are also reported per value of that field: `held_out/True/greedy_accuracy`, ...

Used by the trainer (`run.eval_every`, and before the first iteration with `run.eval_before`) and by
`python -m jgrpo.eval`. Metric names are legal TensorBoard tags: `greedy_accuracy`, `pass_at_4`, `maj_at_4`,
`greedy_length`, `sampled_truncated`, ...
"""

from __future__ import annotations

import collections
import dataclasses
import re
import zlib

import jax
import numpy as np

from jgrpo.config import Config
from jgrpo.config.errors import ConfigError
from jgrpo.data import bucketed_length, build_prompt_iterator
from jgrpo.parallel.host_arrays import global_max, global_sum, local_rows
from jgrpo.parallel.mesh import replicated_key
from jgrpo.rewards import RewardScorer, get_reward
from jgrpo.rollout.episodes import EpisodeRunner
from jgrpo.rollout.estimators import summed_by_label, summed_over_prompts
from jgrpo.rollout.scoring import Scoring, prompt_arrays, sample_and_score
from jgrpo.sampling.methods import SamplingMethod
from jgrpo.sampling.sampler import Sampler


class Evaluator:
    """Greedy accuracy, pass@k and maj@k on the test split, for any params of the model.

    `sampler` is the run's (its model, stop and pad ids, mesh, `sampler.*` options and sampling method): greedy
    evaluation runs it at temperature 0 with one sample per prompt, pass@k with `run.eval_samples` samples."""

    def __init__(self, config: Config, sampler: Sampler, tokenizer, scorer: RewardScorer | None = None,
                 episodes: EpisodeRunner | None = None, split: str = "test"):
        if config.run.eval_batch_size:
            config = dataclasses.replace(config, data=dataclasses.replace(config.data,
                                                                          batch_size=config.run.eval_batch_size))
        self.config, self.tokenizer, self.mesh = config, tokenizer, sampler.mesh
        self.data = list(build_prompt_iterator(config, tokenizer, split=split, shuffle=False, epochs=1,
                                               drop_remainder=False))
        self.batch_size = config.data.batch_size
        longest = max(len(ids) for batch in self.data for ids in batch.token_ids)
        # One width and one (padded) batch size for every test batch: two compiled samplers, whatever the data.
        self.width = global_max(bucketed_length(longest, config.sampler.prompt_bucket))
        self.pad_id = sampler.pad_id
        self.scorer = scorer or RewardScorer(config.reward)
        self._own_scorer = scorer is None
        self.scoring = Scoring(tokenizer, self.scorer, config.reward, config.completion_tokens)
        # The policy itself is evaluated: the compute dtype's KV cache whatever `sampler.kv_cache_dtype` (an int8
        # cache makes the sampler another policy, as int8 weights, which the evaluator never gets).
        sampler = sampler.replace(kv_cache_dtype="auto")
        self.modes = {"greedy": sampler.replace(method=SamplingMethod(temperature=0.0), num_samples=1)}
        if config.run.eval_samples:
            self.modes["sampled"] = sampler.replace(num_samples=config.run.eval_samples)
        self.ks = sorted(set(config.run.eval_k or (1, config.run.eval_samples)))
        # maj@k votes with the first reward function's answers (`fn.answer`, rewards/answers.py); single-turn only
        # (an episode's answer is its last turn, which the record does not keep apart).
        self.answer = None if episodes else getattr(get_reward(config.reward.functions[0]), "answer", None)
        # Multi-turn (env.name): each mode's episodes, on the run's environment workers.
        self.episodes = {mode: episodes.using(s) for mode, s in self.modes.items()} if episodes else None
        self.groups = self._group_labels(config.run.eval_group_by)
        # "held_out/True", ...: run.eval_group_by's metric prefixes, the same in every process (checked)
        self.group_names = sorted({label for batch in self.groups for label in batch})
        self._check_same_groups(config.run.eval_group_by)

    def _group_labels(self, field: str) -> list[list[str]]:
        """Per test batch, each prompt's metric prefix for `run.eval_group_by` ("held_out/True", ...); [] if off."""
        if not field:
            return []
        labels = []
        for batch in self.data:
            for reference, question in zip(batch.references, batch.questions, strict=True):
                if field not in reference:
                    raise ConfigError(f"run.eval_group_by={field!r}: the test row {question[:60]!r} has no field "
                                      f"{field!r} (its fields: {', '.join(sorted(reference))})")
            labels.append([f"{field}/{re.sub(r'[^A-Za-z0-9_.-]', '_', str(r[field]))}" for r in batch.references])
        return labels

    def _check_same_groups(self, field: str) -> None:
        """Every process sums the same metric names: each must see the same values (e.g. True / False)."""
        if not field:
            return
        fingerprint = np.asarray([len(self.group_names), zlib.crc32("|".join(self.group_names).encode())], np.int64)
        if np.any(global_sum(fingerprint) != fingerprint * jax.process_count()):
            raise ConfigError(f"run.eval_group_by={field!r}: the processes' test rows hold different values of "
                              f"{field!r}; group by a field whose few values every process sees")

    def prompt_count(self) -> int:
        """Test prompts over all processes."""
        return int(global_sum(np.asarray([sum(len(batch) for batch in self.data)], np.int64))[0])

    def close(self) -> None:
        if self._own_scorer:
            self.scorer.close()

    def evaluate(self, params, prompts: int = 0) -> dict[str, float]:
        """The metrics over the whole test split, or over its first `prompts` prompts (rounded up to whole
        evaluation batches of `run.eval_batch_size`, the same in every process; 0: all)."""
        self.env_counts = collections.Counter()
        metrics: dict = {}
        batches = -(-prompts // self.batch_size) if prompts else len(self.data)
        for mode, sampler in self.modes.items():
            tally = self._run(params, sampler, mode, batches)
            names = sorted(tally)
            sums = dict(zip(names, global_sum(np.asarray([tally[n] for n in names], np.float64)), strict=True))
            grouped = {g: {n.removeprefix(g + "/"): sums.pop(n) for n in list(sums) if n.startswith(g + "/")}
                       for g in self.group_names}
            prompts = sums.pop("prompts")
            rows = prompts * sampler.num_samples
            for prefix, part in (("", sums), *((g + "/", part) for g, part in grouped.items() if part["prompts"])):
                count = part["prompts"] if prefix else prompts
                if mode == "greedy":
                    metrics.update({f"{prefix}greedy_accuracy": float(part["correct"] / count),
                                    f"{prefix}prompts": int(count)})
                else:
                    metrics.update({f"{prefix}{k}": float(v / count) for k, v in part.items()
                                    if k.startswith(("pass_at_", "maj_at_"))})
            if mode != "greedy":
                metrics["reward_mean"] = float(sums["reward"] / rows)
            metrics.update({f"{mode}_length": float(sums["length"] / rows),
                            f"{mode}_truncated": float(sums["truncated"] / rows)})
        if self.episodes is not None:  # greedy episodes: turns, and how many tool calls were well-formed
            counts = self.env_counts  # this process's episodes; summed over every process
            errors = sum(v for k, v in counts.items() if k.startswith("tool_call_errors/"))
            episodes, turns, calls, errors = global_sum(np.asarray([counts["episodes"], counts["turns"],
                                                                    counts["tool_calls"], errors], np.float64))
            metrics.update({"turns": float(turns / episodes),
                            "tool_call_validity": float(calls / (calls + errors)) if calls + errors else 0.0})
        return metrics

    def _run(self, params, sampler: Sampler, mode: str, batches: int) -> dict[str, float]:
        """This process's sums over its test prompts: prompts, correct samples, rewards, tokens, truncated rows,
        and (sampled) each k's pass@k and maj@k."""
        n = sampler.num_samples
        ks = self.ks if mode == "sampled" else ()
        # Every key from the start: the processes sum the same names, whatever their batches hold.
        scored = ["prompts", "correct", *(f"pass_at_{k}" for k in ks),
                  *(f"maj_at_{k}" for k in ks if self.answer is not None)]  # also per group
        names = [*scored, "reward", "length", "truncated",
                 *(f"{g}/{n}" for g in self.group_names for n in scored)]
        tally = collections.Counter(dict.fromkeys(names, 0.0))
        key = replicated_key(self.config.run.seed + 1, self.mesh)
        local_size = self.batch_size // jax.process_count()
        for index, batch in enumerate(self.data[:batches]):
            real = len(batch)
            key_i = jax.random.fold_in(key, index)
            if self.episodes is not None:
                rollout = self._episodes(params, self.episodes[mode], batch, local_size, key_i, mode == "greedy")
                first = rollout.scores.total[:real * n]  # the environment's and the functions'
            else:
                ids = list(batch.token_ids) + [batch.token_ids[-1]] * (local_size - real)  # pad a short last batch
                padded = prompt_arrays(ids, width=self.width, pad_id=self.pad_id, mesh=self.mesh,
                                       global_prompts=self.batch_size)
                rollout = sample_and_score(sampler, params, padded, batch, key_i, self.scoring)
                first = rollout.scores.per_function[self.config.reward.functions[0]]
            correct = first[:real * n].reshape(real, n) >= 1.0
            tally["prompts"] += real
            tally["correct"] += correct.sum()
            tally["reward"] += rollout.scores.total[:real * n].sum()
            tally["length"] += local_rows(rollout.samples.lengths)[:real * n].sum()
            tally["truncated"] += local_rows(rollout.samples.truncated)[:real * n].sum()
            answers = (None if self.answer is None or not ks else
                       [self.answer(text) for text in rollout.completions[:real * n]])
            if ks:
                tally.update(summed_over_prompts(correct, answers, ks))
            if self.groups:
                tally.update(summed_by_label(correct, answers, ks, self.groups[index][:real]))
        return tally

    def _episodes(self, params, runner: EpisodeRunner, batch, local_size: int, key, count: bool):
        """A test batch's episodes (a short last batch padded with its last prompt, those rows not counted)."""
        short = local_size - len(batch)
        padded = dataclasses.replace(batch, **{f: list(getattr(batch, f)) + [getattr(batch, f)[-1]] * short
                                               for f in ("token_ids", "texts", "questions", "references")})
        opened = runner.open(padded)
        longest = max(len(ids) for ids in opened.token_ids)
        prompts = prompt_arrays(opened.token_ids, width=global_max(bucketed_length(longest,
                                                                                   self.config.sampler.prompt_bucket)),
                                pad_id=self.pad_id, mesh=self.mesh, global_prompts=self.batch_size)
        out, episodes = runner.run(params, prompts, opened, key)
        if count:
            for ep in episodes[:len(batch) * runner.group]:
                self.env_counts.update({"episodes": 1, "turns": ep.turns, "tool_calls": ep.counts["tool_calls"]})
                self.env_counts.update({k: v for k, v in ep.counts.items() if k.startswith("tool_call_errors/")})
        return self.scoring.score_episodes(out, episodes, opened, self.mesh, "zero_reward")
