"""Evaluate on the test split: `python -m jgrpo.eval CONFIG_OR_RUN_DIR [section.field=value ...] [--step N]`.

Over every test prompt (data.split is ignored; the "test" split is used):
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
A run directory evaluates its latest complete checkpoint (or --step); a config file evaluates the model it
names, untrained. Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

import jax
from etils import epath

from jgrpo.config.errors import PathError, exits_on_user_error
from jgrpo.data.prompts import pad_id_for
from jgrpo.parallel import distributed
from jgrpo.parallel.mesh import mesh_platform
from jgrpo.parallel.startup import enable_compilation_cache, setup_logging
from jgrpo.rollout.episodes import EpisodeRunner
from jgrpo.rollout.evaluator import Evaluator
from jgrpo.sampling.sampler import Sampler, stop_ids_for

log = logging.getLogger(__name__)


def load_for_eval(target: str, overrides: list[str], step: int | None = None):
    """(config, graphdef, params, tokenizer, mesh, source description) for a run directory or a config file."""
    from jgrpo.config.loading import load_config
    from jgrpo.models.hf import load_model, load_tokenizer, model_options
    from jgrpo.models.lora import join_adapters, split_adapters
    from jgrpo.parallel.mesh import TRAIN_RULES, make_mesh
    from jgrpo.training.checkpoint import Checkpointer
    from jgrpo.training.fingerprint import fingerprint

    path = epath.Path(target)  # a local run directory or a bucket (gs://...), as train writes it
    run_dir = path if path.is_dir() else None
    if run_dir is not None and not (run_dir / "config.yaml").is_file():
        raise PathError(f"{run_dir} is not a run directory (no config.yaml): give a run directory of "
                        "python -m jgrpo.train or a config file")
    config = load_config(run_dir / "config.yaml" if run_dir else path, overrides)
    mesh = make_mesh(config.mesh)
    m = config.model
    graphdef, params, _ = load_model(m.name, **model_options(m, mesh_platform(mesh)), mesh=mesh, rules=TRAIN_RULES,
                                     lora=(m.lora.rank, m.lora.alpha, m.lora.targets))
    source = f"untrained {m.name}"
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


@exits_on_user_error
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jgrpo.eval", description=__doc__.split("\n\n")[0])
    parser.add_argument("target", help="a run directory (evaluates its checkpoint) or a config file")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. run.eval_samples=8")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    args = parser.parse_intermixed_args(argv)  # overrides before, between or after the flags
    setup_logging()
    enable_compilation_cache()
    distributed.initialize()
    config, graphdef, params, tokenizer, mesh, source = load_for_eval(args.target, args.overrides, args.step)
    sampler = Sampler.from_config(config.sampler, graphdef=graphdef, num_samples=1, mesh=mesh,
                                  stop_ids=stop_ids_for(tokenizer, config.sampler.stop_token_ids),
                                  pad_id=pad_id_for(tokenizer))
    # Multi-turn runs (env.name) evaluate episodes with their environment.
    episodes = EpisodeRunner.from_config(config, sampler=sampler, tokenizer=tokenizer) if config.env.on else None
    evaluator = Evaluator(config, sampler, tokenizer, episodes=episodes)
    try:
        metrics = evaluator.evaluate(params)
    finally:
        evaluator.close()
        if episodes is not None:
            episodes.close()
    if jax.process_index() == 0:
        print(f"evaluation of {source} on the test split of {config.data.source}")
        for key, value in metrics.items():
            print(f"  {key:<16} {value:.4f}" if isinstance(value, float) else f"  {key:<16} {value}")
        print(json.dumps({"source": source, **metrics}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
