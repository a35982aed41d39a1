"""Train: `python -m jgrpo.train CONFIG [section.field=value ...]`.

Writes the resolved config to RUN_DIR/config.yaml, resumes from the latest complete checkpoint there, shows a
progress bar and writes metrics. On SIGTERM (preemption) it saves at the next iteration boundary and exits 0;
run the same command again to continue. Compiled programs are cached on disk (`jgrpo.parallel.startup`), so a
restart skips compiling.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import yaml

from jgrpo.config.errors import exits_on_user_error
from jgrpo.parallel.startup import enable_compilation_cache, setup_logging

EXIT_DIVERGED = 3
EXIT_ROLLOUT_LOST = 4  # two jobs: the rollout job stayed away past rollout.wait_timeout_s (saved first)


def _report_config_change(run_dir: Path, config_dict: dict) -> None:
    """A resumed run whose config differs from the saved one is allowed (e.g. more iterations), but said."""
    saved_file = run_dir / "config.yaml"
    if not saved_file.is_file():
        return
    saved = yaml.safe_load(saved_file.read_text()) or {}
    import json

    now = json.loads(json.dumps(config_dict))
    changes = [f"{section}.{key}: {saved[section].get(key)!r} -> {value!r}"
               for section, fields in now.items() if isinstance(fields, dict) and section in saved
               for key, value in fields.items() if saved[section].get(key) != value]
    if changes:
        logging.getLogger("jgrpo.train").warning("config differs from %s: %s", saved_file, "; ".join(changes))


@exits_on_user_error
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jgrpo.train", description=__doc__.split("\n\n")[0],
                                     epilog="A mistake in the config, a path or the data is reported as one "
                                            "'error:' paragraph (exit status 2); JGRPO_DEBUG=1 adds the traceback.")
    parser.add_argument("config", help="YAML config file (see configs/)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. grpo.beta=0.0 run.iterations=20")
    args = parser.parse_args(argv)
    setup_logging()
    from jgrpo.config.loading import load_config, save_config, to_dict

    config = load_config(args.config, args.overrides)  # before the heavy imports: a typo fails at once
    enable_compilation_cache()

    import jax
    from etils import epath

    from jgrpo.parallel import distributed
    from jgrpo.training.preflight import check_before_loading

    distributed.initialize()
    check_before_loading(config)
    if config.rollout.role == "rollout":  # two jobs: this one samples for the trainer job (it writes no files)
        return _rollout_job(config)
    from jgrpo.rollout.remote import RolloutJobLost
    from jgrpo.training.trainer import (  # the heavy imports (flax, orbax, optax) after the checks
        Trainer,
        TrainingDiverged,
    )

    run_dir = epath.Path(config.run.output_dir)  # a local folder or a bucket (gs://...)
    trainer = Trainer(config)  # data, rewards, model: a start that fails here leaves no config.yaml behind
    try:
        if jax.process_index() == 0:
            _report_config_change(run_dir, to_dict(config))
            save_config(config, run_dir)
        status = trainer.run()
    except TrainingDiverged as e:
        logging.getLogger("jgrpo.train").error("%s", e)
        return EXIT_DIVERGED
    except RolloutJobLost as e:
        logging.getLogger("jgrpo.train").error("%s", e)
        return EXIT_ROLLOUT_LOST
    finally:
        trainer.close()
    logging.getLogger("jgrpo.train").info("%s after iteration %d; run directory %s", status,
                                          trainer.state.iteration, run_dir)
    if jax.process_index() == 0:
        report_run(run_dir)
    return 0


def _rollout_job(config) -> int:
    """`rollout.role: rollout`: sample for the trainer job at `rollout.endpoint` until it ends."""
    from jgrpo.rollout.rollout_job import RolloutJob

    job = RolloutJob(config)
    try:
        return job.run()
    finally:
        job.close()


def report_run(run_dir) -> None:
    """Print the before / after held-out comparison (when the run has one) and draw RUN_DIR/curves.png."""
    from jgrpo.training.curves import plot_runs
    from jgrpo.training.metrics_log import held_out_comparison, read_metrics

    log = logging.getLogger("jgrpo.train")
    comparison = held_out_comparison(read_metrics(run_dir))
    if comparison:
        print(comparison, flush=True)
    try:
        log.info("curves (reward, held-out accuracy, KL, time): %s", plot_runs([run_dir], run_dir / "curves.png"))
    except (OSError, ValueError) as e:  # a plot is a convenience: never fail a finished run over it
        log.warning("could not draw the curves: %s", e)


if __name__ == "__main__":
    sys.exit(main())
