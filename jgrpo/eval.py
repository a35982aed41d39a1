"""Evaluate on the test split: `python -m jgrpo.eval CONFIG_OR_RUN_DIR [section.field=value ...] [--step N]`.

Two numbers per run, over every test prompt (data.split is ignored; the "test" split is used):
  greedy_accuracy   fraction of prompts whose greedy completion the first reward function scores >= 1
  pass@1            mean over prompts of the fraction of k = run.eval_samples sampled completions (with the
                    sampler settings) that are correct; pass@k (any correct) and the mean reward are reported too
A run directory evaluates its latest complete checkpoint (or --step); a config file evaluates the model it
names, untrained. Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

import jax
import numpy as np

from jgrpo import distributed
from jgrpo.config import Config
from jgrpo.data import bucketed_length, build_prompt_iterator
from jgrpo.host_arrays import global_max, global_sum, local_rows, to_global_rows
from jgrpo.mesh import SAMPLE_RULES, mesh_platform, replicated
from jgrpo.models.attention_backends import resolve_attention
from jgrpo.rewards import RewardScorer
from jgrpo.sampler import decode_options, generate, stop_ids_for
from jgrpo.sampling_methods import SamplingMethod

log = logging.getLogger(__name__)


class Evaluator:
    """Greedy accuracy and pass@1 over k samples on the test split, for any params of the model."""

    def __init__(self, config: Config, graphdef, tokenizer, mesh, scorer: RewardScorer | None = None):
        if config.run.eval_batch_size:
            config = dataclasses.replace(config, data=dataclasses.replace(config.data,
                                                                          batch_size=config.run.eval_batch_size))
        self.config, self.graphdef, self.tokenizer, self.mesh = config, graphdef, tokenizer, mesh
        self.data = list(build_prompt_iterator(config, tokenizer, split="test", shuffle=False, epochs=1,
                                               drop_remainder=False))
        self.batch_size = config.data.batch_size
        longest = max(len(ids) for batch in self.data for ids in batch.token_ids)
        # One width and one (padded) batch size for every test batch: two compiled samplers, whatever the data.
        self.width = global_max(bucketed_length(longest, config.sampler.prompt_bucket))
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.stop_ids = stop_ids_for(tokenizer, config.sampler.stop_token_ids)
        self.scorer = scorer or RewardScorer(config.reward)
        self._own_scorer = scorer is None
        sampled = SamplingMethod.from_config(config.sampler, mesh_platform(mesh))
        self.modes = {"greedy": (SamplingMethod(temperature=0.0), 1),
                      "sampled": (sampled, config.run.eval_samples)}

    def close(self) -> None:
        if self._own_scorer:
            self.scorer.close()

    def evaluate(self, params) -> dict[str, float]:
        totals = {}
        for mode, (method, samples) in self.modes.items():
            correct, reward_sum, any_correct, prompts = self._run(params, method, samples)
            totals[mode] = global_sum(np.asarray([correct, reward_sum, any_correct, prompts], np.float64))
        g_correct, _, _, prompts = totals["greedy"]
        s_correct, s_reward, s_any, _ = totals["sampled"]
        k = self.modes["sampled"][1]
        return {
            "greedy_accuracy": float(g_correct / prompts),
            "pass@1": float(s_correct / (prompts * k)),
            f"pass@{k}": float(s_any / prompts),
            "reward_mean": float(s_reward / (prompts * k)),
            "prompts": int(prompts),
        }

    def _run(self, params, method: SamplingMethod, samples: int):
        correct = reward_sum = any_correct = prompts = 0.0
        # Replicated on the mesh by a jit: with several processes a key on one local device cannot enter it.
        key = jax.jit(lambda: jax.random.key(self.config.run.seed + 1), out_shardings=replicated(self.mesh))()
        local_size = self.batch_size // jax.process_count()
        for index, batch in enumerate(self.data):
            real = len(batch)
            ids = list(batch.token_ids) + [batch.token_ids[-1]] * (local_size - real)  # pad a short last batch
            tokens, mask = dataclasses.replace(batch, token_ids=ids).padded(pad_id=self.pad_id, length=self.width)
            out = generate(self.graphdef, params, to_global_rows(tokens, self.mesh, SAMPLE_RULES, self.batch_size),
                           to_global_rows(mask, self.mesh, SAMPLE_RULES, self.batch_size), num_samples=samples,
                           max_new_tokens=self.config.sampler.max_new_tokens, method=method,
                           stop_ids=self.stop_ids, key=jax.random.fold_in(key, index), mesh=self.mesh,
                           rules=SAMPLE_RULES, pad_id=self.pad_id,
                           **decode_options(self.config.sampler))
            rows = real * samples
            out_tokens, lengths = local_rows(out.tokens)[:rows], local_rows(out.lengths)[:rows]
            texts = self.tokenizer.batch_decode([t[:n] for t, n in zip(out_tokens, lengths, strict=True)],
                                                skip_special_tokens=True)
            result = self.scorer.score(batch.questions, texts, batch.references)
            first = result.per_function[self.config.reward.functions[0]].reshape(real, samples) >= 1.0
            correct += first.sum()
            any_correct += first.any(axis=1).sum()
            reward_sum += result.total.sum()
            prompts += real
        return correct, reward_sum, any_correct, prompts


def load_for_eval(target: str, overrides: list[str], step: int | None = None):
    """(config, graphdef, params, tokenizer, mesh, source description) for a run directory or a config file."""
    from jgrpo.checkpoint import Checkpointer
    from jgrpo.config_loading import load_config
    from jgrpo.mesh import TRAIN_RULES, make_mesh
    from jgrpo.models.hf import load_model, load_tokenizer

    path = Path(target)
    run_dir = path if path.is_dir() else None
    if run_dir is not None and not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory (no config.yaml)")
    config = load_config(run_dir / "config.yaml" if run_dir else path, overrides)
    mesh = make_mesh(config.mesh)
    m = config.model
    graphdef, params, _ = load_model(m.name, param_dtype=m.param_dtype, compute_dtype=m.compute_dtype,
                                     attention=resolve_attention(m.attention, mesh_platform(mesh)),
                                     mesh=mesh, rules=TRAIN_RULES)
    source = f"untrained {m.name}"
    if run_dir is not None and (run_dir / "checkpoints").is_dir():
        restored = Checkpointer(run_dir, config.checkpoint, read_only=True).restore_params(params, step=step)
        if restored is not None:
            params, iteration = restored
            source = f"{run_dir} at iteration {iteration}"
    elif step is not None:
        raise FileNotFoundError(f"--step {step} given but {target} has no checkpoints")
    return config, graphdef, params, load_tokenizer(m.name), mesh, source


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jgrpo.eval", description=__doc__.split("\n\n")[0])
    parser.add_argument("target", help="a run directory (evaluates its checkpoint) or a config file")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. run.eval_samples=8")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    args = parser.parse_args(argv)
    from jgrpo.train import enable_compilation_cache, setup_logging

    setup_logging()
    enable_compilation_cache()
    try:
        distributed.initialize()
    except ValueError as e:
        print(f"distributed setup error: {e}", file=sys.stderr)
        return 2
    try:
        config, graphdef, params, tokenizer, mesh, source = load_for_eval(args.target, args.overrides, args.step)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    evaluator = Evaluator(config, graphdef, tokenizer, mesh)
    try:
        metrics = evaluator.evaluate(params)
    finally:
        evaluator.close()
    if jax.process_index() == 0:
        print(f"evaluation of {source} on the test split of {config.data.source}")
        for key, value in metrics.items():
            print(f"  {key:<16} {value:.4f}" if isinstance(value, float) else f"  {key:<16} {value}")
        print(json.dumps({"source": source, **metrics}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
