"""The off-policy study's configurations are valid runs, and its verdict rule reads as documented."""

import importlib.util
import sys
from pathlib import Path

import pytest

from jgrpo.config.loading import load_config

STUDY = Path(__file__).resolve().parents[1] / "experiments" / "offpolicy"


def _module(name):
    sys.path.insert(0, str(STUDY))
    try:
        spec = importlib.util.spec_from_file_location(f"offpolicy_{name}", STUDY / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(STUDY))


RUN = _module("run")


@pytest.mark.parametrize("name", list(RUN.RUNS))
def test_every_configuration_loads(name, tmp_path):
    cmd = RUN.command(tmp_path / name, 1, RUN.RUNS[name])
    config = load_config(cmd[3], cmd[4:])
    assert config.run.seed == 1 and config.data.shuffle_seed == 1 and config.run.iterations == 60
    assert config.data.arithmetic_operators == "+*"
    v = config.grpo.behaviour_refresh
    assert (v == 1) == name.startswith("onpolicy")


def test_verdict_is_one_standard_error_below_masked_on_policy():
    report = _module("report")

    def runs(*greedy):
        return [{"greedy": g, "greedy_evals": g, "pass1": 0.0, "reward_last10": 0.0, "s_per_iteration": 1.0,
                 "minutes": 1.0, "tv_theta_alpha": 0.0, "tv_k_alpha": 0.0, "M": 0.0, "lower_bound": 0.0,
                 "intervened": 0.0, "refreshes": 0.0} for g in greedy]

    # Reference 0.4, 0.5, 0.6: mean 0.5, SE = 0.1 / sqrt(3) = 0.0577 -> threshold 0.4423.
    table = {name: [] for name in RUN.RUNS}
    table |= {"onpolicy_masked": runs(0.4, 0.5, 0.6), "v10_recentred": runs(0.44, 0.45, 0.45),
              "v10_behaviour": runs(0.40, 0.45, 0.45), "v10_cispo": runs(0.9)}
    lines = report.markdown(table, None).splitlines()
    rows = {line.split(" | ")[0][2:]: line for line in lines if line.startswith("| ")}
    assert "| 0.50 ± 0.06 |" in rows["onpolicy_masked"] and "(reference)" in rows["onpolicy_masked"]
    assert "| yes |" in rows["v10_recentred"]  # mean 0.4467 >= 0.4423
    assert "| no |" in rows["v10_behaviour"]  # mean 0.4333 < 0.4423
    assert "n/a (< 2 seeds)" in rows["v10_cispo"]
    assert rows["adaptive"].startswith("| adaptive | 0 |")
