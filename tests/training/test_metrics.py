"""Metrics sinks (JSONL, TensorBoard, progress bar, samples), resume truncation, and the plot CLI."""

import json
import struct

import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from jgrpo.config import LoggingConfig
from jgrpo.plot import main as plot_main
from jgrpo.training.metrics_log import MetricsLogger, progress_summary, read_jsonl, read_metrics


def _tb_scalars(run_dir):
    """(tag, step, value) of every scalar in the run's TensorBoard event files (TFRecord framing)."""
    out = []
    for path in sorted((run_dir / "tensorboard").iterdir()):
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length])
            pos += 12 + length + 4
            out += [(v.tag, event.step, v.simple_value) for v in event.summary.value]
    return out


def test_records_go_to_jsonl_tensorboard_and_the_bar(tmp_path, capsys):
    config = LoggingConfig(samples_every=2)
    with MetricsLogger(tmp_path, config, total_iterations=3, enabled=True) as logger:
        for it in (1, 2, 3):
            logger.log(it, {"reward/mean": np.float32(0.25 * it), "accuracy": 0.5, "time/iteration": 1.5,
                            "nonfinite": False, **({"eval/greedy_accuracy": 0.4} if it == 2 else {})})
        assert [logger.should_dump_samples(i) for i in (1, 2, 3, 4)] == [True, True, False, True]
        logger.log_samples(2, [{"prompt": "1+1=", "completion": "2", "reward": np.float64(1.0)}])
        assert logger._bar.n == 3
    records = read_metrics(tmp_path)
    assert [r["iteration"] for r in records] == [1, 2, 3]
    assert records[2]["reward/mean"] == pytest.approx(0.75) and isinstance(records[2]["reward/mean"], float)
    assert read_jsonl(tmp_path / "samples.jsonl") == [
        {"iteration": 2, "prompt": "1+1=", "completion": "2", "reward": 1.0}
    ]
    scalars = _tb_scalars(tmp_path)
    assert ("reward/mean", 3, pytest.approx(0.75)) in scalars
    assert not any(tag == "nonfinite" for tag, _, _ in scalars)  # booleans stay out of TensorBoard
    bar = capsys.readouterr().err
    # The iteration's mean reward, then the mean over the last (up to) 5 iterations: (0.25 + 0.5 + 0.75) / 3.
    assert "reward=0.750 avg5=0.500" in bar
    assert "held-out=0.40" in bar.rsplit("reward=0.750", 1)[1]  # the latest evaluation stays in the bar


def test_other_processes_write_nothing(tmp_path):
    with MetricsLogger(tmp_path / "run", LoggingConfig(), total_iterations=2, enabled=False) as logger:
        record = logger.log(1, {"reward/mean": 1.0})
        logger.log_samples(1, [{"prompt": "x"}])
    assert record == {"iteration": 1, "reward/mean": 1.0}
    assert not (tmp_path / "run").exists()


def test_resume_drops_records_after_the_checkpoint(tmp_path):
    config = LoggingConfig(tensorboard=False, progress_bar=False, samples_every=1)
    with MetricsLogger(tmp_path, config, total_iterations=5, enabled=True) as logger:
        for it in range(1, 5):
            logger.log(it, {"loss": float(it)})
            logger.log_samples(it, [{"completion": str(it)}])
    # The run died after iteration 4 but its last checkpoint is iteration 3: iteration 4 is redone.
    with MetricsLogger(tmp_path, config, total_iterations=5, start_iteration=3, enabled=True) as logger:
        logger.log(4, {"loss": 40.0})
    assert [(r["iteration"], r["loss"]) for r in read_metrics(tmp_path)] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]
    assert [r["iteration"] for r in read_jsonl(tmp_path / "samples.jsonl")] == [1, 2, 3]


def test_progress_summary_formats_key_numbers():
    line = progress_summary({"reward/mean": 0.41234, "accuracy": 0.375, "kl/mean": 0.00123,
                             "completion/length_mean": 31.4, "throughput/tokens_per_s": float("nan")})
    assert line == "reward=0.412 acc=0.38 kl=1.23e-03 len=31 tok/s=nan"
    with pytest.raises(ValueError, match="scalars"):
        MetricsLogger("unused", LoggingConfig(), 1, enabled=False).log(1, {"x": np.zeros(3)})


def test_plot_writes_a_png_of_several_runs(tmp_path, capsys):
    for name, slope in (("on_policy", 0.1), ("off_policy", 0.05)):
        run = tmp_path / name
        run.mkdir()
        lines = [{"iteration": i, "reward/mean": slope * i, "kl/mean": 0.01 * i, "time/iteration": 2.0}
                 for i in range(1, 6)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    out = tmp_path / "plots" / "curves.png"
    assert plot_main([str(tmp_path / "on_policy"), str(tmp_path / "off_policy"), "-o", str(out), "--smooth", "2"]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 1.5 * height  # three panels in a row: reward, KL, time (nothing else was logged)
    assert plot_main([str(tmp_path / "on_policy"), "-o", str(out), "--x", "wallclock"]) == 0
    assert plot_main([str(tmp_path / "missing"), "-o", str(out)]) == 2
    assert "no metrics" in capsys.readouterr().err


def test_only_panels_with_data_are_drawn():
    from jgrpo.training.curves import panels_with_data, with_training_time

    train = [{"iteration": i, "reward/mean": 0.1 * i, "accuracy": 0.1 * i, "time/iteration": 2.0} for i in (1, 2)]
    evaluated = [{"iteration": 0, "eval/greedy_accuracy": 0.12}, *train, {"iteration": 2, "eval/greedy_accuracy": 0.5}]
    # accuracy repeats the mean reward (one 0/1 reward): no panel of its own; no KL, no pass@1 logged: none either.
    keys = [k for k, _ in panels_with_data([("a", [with_training_time(r) for r in evaluated])])]
    assert keys == ["reward/mean", "eval/greedy_accuracy", "time/training"]
    two_rewards = [r | {"accuracy": 0.0} for r in train]  # accuracy of the first of two reward functions differs
    assert "accuracy" in [k for k, _ in panels_with_data([("a", train), ("b", two_rewards)])]


def test_plot_wallclock_axis_sums_iteration_time_without_evaluation():
    from jgrpo.training.curves import _x_values

    records = [{"iteration": 2, "time/iteration": 3.0}, {"iteration": 1, "time/iteration": 2.0},
               {"iteration": 3, "time/iteration": 14.0, "time/eval": 10.0}]
    assert _x_values(records, "wallclock") == {1: 2.0, 2: 5.0, 3: 9.0}
    assert _x_values(records, "iteration") == {2: 2.0, 1: 1.0, 3: 3.0}


def test_an_iterations_extremes_are_the_extremes_of_its_updates():
    from jgrpo.training.iteration_record import _update_means

    def update(ratio_min, ratio_max, ratio_mean):
        return {"ratio_min": ratio_min, "ratio_max": ratio_max, "ratio_mean": ratio_mean, "token_count": 10.0,
                "empty": 0.0, "lp_k_exact": 0.0}

    record = _update_means([update(0.9, 1.5, 1.0), update(0.7, 2.0, 1.2)], behaviour_is_current=True)
    assert record["loss/ratio_min"] == pytest.approx(0.7)  # not the mean of the two minima (0.8)
    assert record["loss/ratio_max"] == pytest.approx(2.0)  # not 1.75
    assert record["loss/ratio_mean"] == pytest.approx(1.1)
    assert record["loss/token_count"] == pytest.approx(10.0)


def test_held_out_comparison_sets_the_first_evaluation_beside_the_last():
    from jgrpo.training.metrics_log import held_out_comparison

    records = [{"iteration": 0, "eval/greedy_accuracy": 0.12, "eval/prompts": 100},
               {"iteration": 1, "reward/mean": 0.2},
               {"iteration": 10, "eval/greedy_accuracy": 0.3, "eval/pass_at_1": 0.2, "eval/prompts": 100},
               {"iteration": 20, "eval/greedy_accuracy": 0.61, "eval/pass_at_1": 0.5, "eval/prompts": 100}]
    text = held_out_comparison(records)
    assert "iteration    0" in text and "iteration   20" in text
    assert "0.120" in text and "0.610" in text
    assert "pass@1" not in text  # the first evaluation had no pass@1: no half-empty row
    assert text.splitlines()[-1] == "greedy accuracy rose: 0.12 -> 0.61 (+49 points)"
    assert held_out_comparison(records[:2]) is None  # one evaluation: nothing to compare
    fell = held_out_comparison([records[2], {**records[0], "iteration": 30}])
    assert fell.splitlines()[-1] == "greedy accuracy did not rise: 0.30 -> 0.12 (-18 points)"


def test_tensorboard_tags_are_legal_without_warnings(tmp_path, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="tensorboardX")
    with MetricsLogger(tmp_path, LoggingConfig(progress_bar=False), total_iterations=1, enabled=True) as logger:
        logger.log(1, {"eval/pass_at_1": 0.5, "reward/my_rewards:digits": 1.0})
    assert not [r for r in caplog.records if "illegal" in r.getMessage()]
    tags = {tag for tag, _, _ in _tb_scalars(tmp_path)}
    assert tags == {"eval/pass_at_1", "reward/my_rewards_digits"}
    assert read_metrics(tmp_path)[0]["reward/my_rewards:digits"] == 1.0  # the JSONL keeps the exact name


def test_wandb_sink_logs_config_scalars_and_samples_offline_and_resumes_the_same_run(tmp_path):
    pytest.importorskip("wandb", reason="the wandb extra (part of the test extra)")
    config = LoggingConfig(tensorboard=False, progress_bar=False, wandb_project="jgrpo-test", wandb_mode="offline")
    with MetricsLogger(tmp_path, config, total_iterations=3, run_config={"grpo": {"beta": 0.04}}) as logger:
        # As the trainer does: an iteration's samples, then its scalars (which complete the iteration's row).
        logger.log_samples(1, [{"prompt": "1+1?", "completion": "2", "reward": 1.0, "rewards": [1.0, 0.0]}])
        logger.log(1, {"reward/mean": 0.25, "kl/mean": float("nan")})
        run = logger._wandb.run
        assert run.summary["reward/mean"] == 0.25 and "kl/mean" not in run.summary.keys()  # NaN stays in the JSONL
        assert run.summary["samples"]["_type"] == "table-file"
        logger.log(2, {"reward/mean": 0.5})
        assert run.summary["reward/mean"] == 0.5 and run.step == 3
        assert run.config["grpo"] == {"beta": 0.04} and run.offline
    run_id = (tmp_path / "wandb_run_id").read_text().strip()
    assert list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    with MetricsLogger(tmp_path, config, total_iterations=3, start_iteration=2) as logger:  # a resumed run
        assert logger._wandb.run.id == run_id


def test_wandb_without_the_package_is_a_config_error(monkeypatch):
    import sys

    from jgrpo.config import ConfigError
    from jgrpo.training.wandb_sink import require_wandb

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(ConfigError, match=r"logging.wandb_project='p' needs the wandb package.*jgrpo\[wandb\]"):
        require_wandb(LoggingConfig(wandb_project="p"))
    require_wandb(LoggingConfig(wandb_project="p", wandb_mode="disabled"))  # nothing asked of the package
