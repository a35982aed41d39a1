"""Evaluate a model: `python -m jgrpo.eval RUN_DIR|CONFIG|MODEL_DIR [k=v ...] [--data FILE ...] [--reward NAME]
[--samples N] [--k 1,4,8] [--step N] [--report FILE]`.

A run directory evaluates its latest complete checkpoint (or --step) with its config, data and reward; a config
file the model it names, untrained; a model directory (an exported HF directory or a local hub snapshot) needs
--data and --reward. Precedence: flags over `k=v` overrides over the run's (or config file's) values over the
defaults. Each --data (a local JSONL / Parquet file or saved dataset, GSM8K, MATH or AIME format as `data.format`
reads them; several allowed) is evaluated whole, one table row each; without it, the test split of the run's
`data.source`.

Over every prompt of the evaluated data:
  greedy_accuracy   fraction of prompts whose greedy completion the first reward function scores >= 1
  pass_at_k         over n = run.eval_samples sampled completions per prompt (with the sampler settings), c of them
                    correct: the unbiased 1 - C(n-c, k) / C(n, k), averaged over prompts, for each k of run.eval_k
                    (default 1 and n); pass_at_1 is the mean share of correct samples
  maj_at_k          the majority answer of the first k samples is correct (ties: the answer seen first; no answer:
                    wrong); answers are the first reward function's (`fn.answer`: gsm8k, exact_numeric, math_verify)
  *_length, *_truncated   mean completion tokens and the share cut by the token budget, greedy and sampled
  reward_mean       the sampled completions' mean reward
With an environment (env.name) a completion is an episode, correct when its reward (the environment's and the
reward functions' on its last turn) is >= 1; the greedy episodes' mean turns and tool-call validity (well-formed
calls / all calls) are reported too, and no maj_at_k; with env.tools=[] the same questions without tools.
Prints a table and one JSON line per dataset (the last line: the last dataset), and writes the report
({"source", "datasets": {data: metrics}}) to --report (default: RUN_DIR/eval.json for a run directory).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys

import jax
from etils import epath

from jgrpo.config.errors import ConfigError, PathError, exits_on_user_error
from jgrpo.data.pipeline import BUILTIN_TASKS
from jgrpo.data.prompts import pad_id_for
from jgrpo.parallel import distributed
from jgrpo.parallel.mesh import mesh_platform
from jgrpo.parallel.startup import enable_compilation_cache, setup_logging
from jgrpo.rewards import RewardScorer
from jgrpo.rollout.episodes import EpisodeRunner
from jgrpo.rollout.evaluator import Evaluator
from jgrpo.sampling.sampler import Sampler, stop_ids_for

log = logging.getLogger(__name__)


def is_model_dir(path: epath.Path) -> bool:
    """An HF model directory (config.json, no run's config.yaml): it brings no data and no reward."""
    return path.is_dir() and (path / "config.json").is_file() and not (path / "config.yaml").is_file()


def load_for_eval(target: str, overrides: list[str], step: int | None = None):
    """(config, graphdef, params, tokenizer, mesh, source description) for a run directory, a config file or a
    model directory (HF files: config.json and weights)."""
    from jgrpo.config.loading import load_config
    from jgrpo.models.hf import load_model, load_tokenizer, model_options
    from jgrpo.models.lora import join_adapters, split_adapters
    from jgrpo.parallel.fingerprint import fingerprint
    from jgrpo.parallel.mesh import TRAIN_RULES, make_mesh
    from jgrpo.training.checkpoint import Checkpointer

    path = epath.Path(target)  # a local run directory or a bucket (gs://...), as train writes it
    model_dir = is_model_dir(path)
    run_dir = path if path.is_dir() and not model_dir else None
    if run_dir is not None and not (run_dir / "config.yaml").is_file():
        raise PathError(f"{run_dir} is neither a run directory (no config.yaml) nor a model directory (no "
                        "config.json): give a run directory of python -m jgrpo.train, a config file or an HF model "
                        "directory")
    if model_dir:
        config = load_config(None, [f"model.name={path}", *overrides])
    else:
        config = load_config(run_dir / "config.yaml" if run_dir else path, overrides)
    mesh = make_mesh(config.mesh)
    m = config.model
    graphdef, params, _ = load_model(m.name, model_options(m, mesh_platform(mesh)), mesh=mesh, rules=TRAIN_RULES,
                                     lora=(m.lora.rank, m.lora.alpha, m.lora.targets))
    # A config names a base model (untrained); a model directory holds whatever weights were written there.
    source = f"model directory {m.name}" if model_dir else f"untrained {m.name}"
    if run_dir is not None and (run_dir / "checkpoints").is_dir():
        # A LoRA run's checkpoint holds adapters: restored for this base only, then joined with it.
        trained, base = split_adapters(params) if m.lora.rank else (params, None)
        base_id = (m.name, fingerprint(base)) if base is not None else None
        restored = Checkpointer(run_dir, config.checkpoint, read_only=True, base=base_id).restore_params(trained,
                                                                                                        step=step)
        if restored is not None:
            trained, iteration = restored
            params = join_adapters(trained, base)
            source = f"{run_dir} at iteration {iteration}"
    elif step is not None:
        raise PathError(f"--step {step} given but {target} has no checkpoints")
    return config, graphdef, params, load_tokenizer(m.name), mesh, source


def _flag_overrides(args) -> list[str]:
    """The flags as dotted overrides (they come after the `k=v` ones: flags win)."""
    out = []
    if args.reward:
        out.append(f"reward.functions=[{args.reward}]")
        out.append(f"reward.weights=[{','.join('1.0' for _ in args.reward.split(','))}]")
    if args.samples is not None:
        out.append(f"run.eval_samples={args.samples}")
    if args.k:
        out.append(f"run.eval_k=[{args.k}]")
    if args.group_by is not None:
        out.append(f"run.eval_group_by={args.group_by}")
    return out


def _whole_split(source: str) -> str:
    """The split that reads --data `source`: a built-in task's, a `{split}` path's or a saved DatasetDict's test
    split; a single file's or dataset's one (train) split, all of it."""
    path = epath.Path(source)
    test = source in BUILTIN_TASKS or "{split}" in source or (path / "dataset_dict.json").exists()
    return "test" if test else "train"


@exits_on_user_error
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jgrpo.eval", description=__doc__.split("\n\n")[0],
                                     epilog="Precedence: flags > k=v overrides > the run's config > defaults.")
    parser.add_argument("target", help="a run directory (its checkpoint), a config file (its model, untrained) or "
                                       "a model directory (HF files; needs --data and --reward)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. sampler.temperature=0.6")
    parser.add_argument("--data", action="append", default=None,
                        help="a local JSONL / Parquet file or saved dataset, evaluated whole (several allowed); "
                             "default: the test split of the run's data.source")
    parser.add_argument("--reward", default=None, help="reward function(s), comma-separated (reward.functions); "
                                                       "the first decides correctness")
    parser.add_argument("--samples", type=int, default=None, help="samples per prompt, n (run.eval_samples)")
    parser.add_argument("--k", default=None, help="comma-separated k of pass@k and maj@k (run.eval_k), each <= n")
    parser.add_argument("--group-by", default=None, help="a field of the data rows (e.g. held_out, type): the scores "
                                                         "also per value of it (run.eval_group_by)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    parser.add_argument("--report", default=None, help="the JSON report's path (default: RUN_DIR/eval.json for a "
                                                       "run directory, else none)")
    args = parser.parse_intermixed_args(argv)  # overrides before, between or after the flags
    if is_model_dir(epath.Path(args.target)) and not (args.data and args.reward):
        raise ConfigError(f"{args.target} is a model directory: it brings no data and no reward; give --data FILE "
                          "and --reward NAME (e.g. --data data/gsm8k_test.jsonl --reward gsm8k)")
    setup_logging()
    enable_compilation_cache()
    distributed.initialize()
    config, graphdef, params, tokenizer, mesh, source = load_for_eval(
        args.target, [*args.overrides, *_flag_overrides(args)], args.step)
    sampler = Sampler.from_config(config.sampler, graphdef=graphdef, num_samples=1, mesh=mesh,
                                  stop_ids=stop_ids_for(tokenizer, config.sampler.stop_token_ids),
                                  pad_id=pad_id_for(tokenizer))
    # Multi-turn runs (env.name) evaluate episodes with their environment.
    episodes = EpisodeRunner.from_config(config, sampler=sampler, tokenizer=tokenizer) if config.env.on else None
    # A --data file is read in its own format (auto-detected) unless data.format is given on the command line.
    data_format = config.data.format if any(o.startswith("data.format=") for o in args.overrides) else "auto"
    datasets = {name: (dataclasses.replace(config, data=dataclasses.replace(config.data, source=name,
                                                                            format=data_format)),
                       _whole_split(name)) for name in args.data} if args.data else {
        f"{config.data.source} (test)": (config, "test")}
    scorer = RewardScorer(config.reward)
    results = {}
    try:
        for name, (data_config, split) in datasets.items():
            evaluator = Evaluator(data_config, sampler, tokenizer, scorer=scorer, episodes=episodes, split=split)
            results[name] = evaluator.evaluate(params)
    finally:
        scorer.close()
        if episodes is not None:
            episodes.close()
    if jax.process_index() == 0:
        print(f"evaluation of {source}")
        print(metrics_table(results))
        for name, metrics in results.items():
            print(json.dumps({"source": source, "data": name, **metrics}))
        run_dir = args.target if epath.Path(args.target, "config.yaml").is_file() else None
        report = args.report or (run_dir and str(epath.Path(run_dir) / "eval.json"))
        if report:
            epath.Path(report).write_text(json.dumps({"source": source, "datasets": results}, indent=1))
    return 0


def metrics_table(results: dict[str, dict]) -> str:
    """A markdown table: one row per dataset, then one per group of `run.eval_group_by` ("held_out/True":
    the metric names' prefix), one column per metric (in the first dataset's order)."""
    columns = [c for c in next(iter(results.values())) if "/" not in c]
    lines = ["| data | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for name, metrics in results.items():
        groups = sorted({c.rsplit("/", 1)[0] for c in metrics if "/" in c})
        for label, prefix in ((name, ""), *((f"{name} [{g.replace('/', '=')}]", g + "/") for g in groups)):
            cells = [f"{metrics[prefix + c]:.4f}" if isinstance(metrics.get(prefix + c), float)
                     else str(metrics.get(prefix + c, "")) for c in columns]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)

if __name__ == "__main__":
    sys.exit(main())
