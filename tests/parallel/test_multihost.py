"""Multi-host training, proven on one machine: two processes x 4 CPU devices joined by jax.distributed (and
packed training over two processes x 2).

Acceptance (issue 7): the tiny config run by two processes for 3 iterations, saved, and resumed for 2 more
ends with the params of one process with 8 devices running 5 iterations straight (to 1e-5: collectives may
sum in another order), and the metrics file holds exactly one record per iteration. Every run is a fresh
`python -m jgrpo.train` process, as on a pod slice where each host launches the same command.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from etils import epath
from etils.epath.testing import mock_epath

from jgrpo.config import LoggingConfig
from jgrpo.config.loading import load_config, save_config
from jgrpo.parallel import distributed
from jgrpo.training.metrics_log import MetricsLogger, read_jsonl, read_metrics
from tests.helpers import ROOT, child_xla_flags

# A reward with spread inside each group (the tiny model never solves additions, which would leave every
# advantage 0 and the params unchanged), v = 5 so a behaviour copy is saved at 3 and restored across processes,
# and beta > 0 so the reference model is in play.
# The two layouts sum in other orders, so their params part by rounding; sampling from params that differ by
# rounding can flip a draw (a uniform within rounding of a CDF boundary) and then the runs part for good: on
# one machine params ~1e-7 apart after 2 updates drew another token in iteration 3, on another they did not.
# With v = 5 every iteration samples from the behaviour copy of the initial params, bit-identical in both
# layouts, so both draw the same tokens on any machine and only the updates' rounding remains (a resume that
# lost the behaviour copy would sample iterations 4-5 from other params and fail). Adam turns a gradient entry
# that is ~0 up to rounding into a step of +-lr with a sign that depends on the order, so eps is raised from
# 1e-8 (below it steps stay proportional to the gradient).
OVERRIDES = ["reward.functions=[tests.helpers:space_fraction]", "grpo.behaviour_refresh=5", "grpo.beta=0.04",
             "optim.eps=1e-5", "optim.learning_rate=1e-4", "checkpoint.every=3", "logging.samples_every=0"]


@pytest.fixture(scope="module")
def env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("JGRPO_")}
    env.update(
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
        # JAX_COMPILATION_CACHE_DIR: the suite's (tests/conftest.py): the resumed pair reuses the first's programs.
    )
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(run_dir, env, iterations, devices, process=None, extra=()):
    """Start `python -m jgrpo.train` with `devices` CPU devices; `process` = (coordinator, count, id); `extra`
    overrides after the module's."""
    env = dict(env, XLA_FLAGS=child_xla_flags(devices))
    if process is not None:
        coordinator, count, index = process
        env.update(JGRPO_COORDINATOR=coordinator, JGRPO_NUM_PROCESSES=str(count), JGRPO_PROCESS_ID=str(index))
    cmd = [sys.executable, "-m", "jgrpo.train", "configs/tiny.yaml", f"run.output_dir={run_dir}",
           f"run.iterations={iterations}", *OVERRIDES, *extra]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _two_processes(run_dir, env, iterations, devices=4, extra=()):
    coordinator = f"127.0.0.1:{_free_port()}"
    return [_train(run_dir, env, iterations, devices, (coordinator, 2, i), extra) for i in range(2)]


def _finish(procs, timeout=900):
    for proc in procs:
        out, _ = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, f"training exited with {proc.returncode}:\n{out[-4000:]}"


def _params(run_dir, step):
    """The saved params of `step` as numpy arrays (read without any sharding)."""
    path = (Path(run_dir) / "checkpoints" / str(step) / "params").absolute()
    with ocp.PyTreeCheckpointer() as ckptr:
        metadata = ckptr.metadata(path).item_metadata.tree
        restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), metadata)
        return ckptr.restore(path, args=ocp.args.PyTreeRestore(restore_args=restore_args))


@pytest.mark.slow
def test_two_processes_save_resume_match_one_process(tmp_path, env):
    multi, single = tmp_path / "two_processes", tmp_path / "one_process"
    # The one-process reference runs alongside the first leg of the pair (3 processes on the shared cores).
    reference = _train(single, env, 5, 8)
    _finish(_two_processes(multi, env, 3))
    assert sorted(int(p.name) for p in (multi / "checkpoints").iterdir()) == [3]
    assert [r["iteration"] for r in read_metrics(multi)] == [1, 2, 3]
    _finish(_two_processes(multi, env, 5))
    _finish([reference])

    got, want = _params(multi, 5), _params(single, 5)
    initial = _params(multi, 3)
    leaves = jax.tree.leaves_with_path(want)
    assert len(leaves) == len(jax.tree.leaves(got)) > 0
    moved = 0.0
    for (path, w), g, i in zip(leaves, jax.tree.leaves(got), jax.tree.leaves(initial), strict=True):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-5, err_msg=jax.tree_util.keystr(path))
        moved = max(moved, float(np.abs(w - i).max()))
    assert moved > 5e-5, "the last two iterations did not change the params: the comparison would prove nothing"

    # Written by process 0 only: one record per iteration, and the same history as the one-process run.
    records, reference_records = read_metrics(multi), read_metrics(single)
    assert [r["iteration"] for r in records] == [1, 2, 3, 4, 5]
    for r, ref in zip(records, reference_records, strict=True):
        for key in ("reward/mean", "completion/length_mean", "loss/loss", "kl/mean"):
            np.testing.assert_allclose(r[key], ref[key], rtol=1e-4, atol=1e-6, err_msg=f"{key} at {r['iteration']}")


@pytest.mark.pod
@pytest.mark.slow
def test_a_packed_run_over_two_processes_matches_one_process(tmp_path, env):
    # model.packing over 2 processes x 2 devices: every process fetches the batch's lengths (its rows are split over
    # both), plans the same packing and gathers on the devices; 2 iterations equal one process with 4 devices (to
    # rounding). Stop ids on a quarter of the vocabulary give the random model completions of 1 to 8 tokens, so
    # rows hold several completions (the fill well below 1) in 2 minibatches, the reference's pass included.
    stops = "[" + ",".join(str(i) for i in range(0, 49152, 4)) + "]"
    extra = ("model.packing=true", "grpo.num_minibatches=2", "grpo.micro_batches=2", "checkpoint.every=2",
             f"sampler.stop_token_ids={stops}")
    multi, single = tmp_path / "two_processes", tmp_path / "one_process"
    reference = _train(single, env, 2, 4, extra=extra)
    _finish(_two_processes(multi, env, 2, devices=2, extra=extra))
    _finish([reference])
    for (path, w), g in zip(jax.tree.leaves_with_path(_params(single, 2)), jax.tree.leaves(_params(multi, 2)),
                            strict=True):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-5, err_msg=jax.tree_util.keystr(path))
    records, reference_records = read_metrics(multi), read_metrics(single)
    assert [r["iteration"] for r in records] == [1, 2]
    assert all(r["packing/fill"] < 0.6 for r in records)
    for r, ref in zip(records, reference_records, strict=True):
        for key in ("packing/fill", "completion/length_mean", "loss/loss", "kl/mean"):
            np.testing.assert_allclose(r[key], ref[key], rtol=1e-4, atol=1e-6, err_msg=f"{key} at {r['iteration']}")


# `host_arrays.fetch` on 2 processes x 2 devices: rows split over all 4 devices (a pod's batch: what packing reads
# its lengths from), a replicated array, and one held by process 1 alone all arrive whole on both hosts.
FETCH_WORKER = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(sys.argv[1], 2, int(sys.argv[2]))
from jgrpo.parallel.host_arrays import fetch
devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
everywhere, second = Mesh(np.array(devices), ("fsdp",)), Mesh(np.array(devices[2:]), ("fsdp",))
make = jax.jit(lambda: jnp.arange(24).reshape(8, 3), out_shardings=NamedSharding(everywhere, P("fsdp")))
rows = make()
replicated = jax.device_put(rows, NamedSharding(everywhere, P()))
held = jax.jit(lambda: jnp.arange(6) * 2, out_shardings=NamedSharding(second, P("fsdp")))()
got = fetch({"rows": rows, "replicated": replicated, "held": held, "plain": np.ones(2)})
print(json.dumps({k: np.asarray(v).tolist() for k, v in got.items()}))
"""


@pytest.mark.slow
def test_fetch_brings_arrays_split_over_processes_whole_to_every_host(tmp_path, env):
    script = tmp_path / "worker.py"
    script.write_text(FETCH_WORKER)
    coordinator = f"127.0.0.1:{_free_port()}"
    logs = [tmp_path / f"process{i}.log" for i in range(2)]  # files: a full pipe would stall its process
    procs = [subprocess.Popen([sys.executable, str(script), coordinator, str(i)], cwd=ROOT, text=True,
                              env=dict(env, XLA_FLAGS=child_xla_flags(2)),
                              stdout=log.open("w"), stderr=(tmp_path / f"process{i}.err").open("w"))
             for i, log in enumerate(logs)]
    for i, p in enumerate(procs):
        assert p.wait(timeout=300) == 0, (tmp_path / f"process{i}.err").read_text()[-3000:]
    want = {"rows": np.arange(24).reshape(8, 3).tolist(), "replicated": np.arange(24).reshape(8, 3).tolist(),
            "held": (np.arange(6) * 2).tolist(), "plain": [1.0, 1.0]}
    for log in logs:
        assert json.loads(log.read_text().strip().splitlines()[-1]) == want


# `latest_data_state` on 2 processes, the second 3 s late: process 0 finds no checkpoint and goes on to make the
# folder (as its checkpointer does), then waits at a barrier. Deciding by what each process saw, the late one
# found the folder and opened Orbax's barriers alone (a name mismatch, or a hang); now process 0 decides for both.
RESUME_CHECK_WORKER = """
import sys, time
import jax
from jax.experimental import multihost_utils
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(sys.argv[1], 2, int(sys.argv[2]))
from etils import epath
from jgrpo.training.checkpoint import latest_data_state
run_dir = epath.Path(sys.argv[3])
if jax.process_index() == 1:
    time.sleep(3)
print("state", latest_data_state(run_dir), flush=True)
if jax.process_index() == 0:
    (run_dir / "checkpoints").mkdir(parents=True)
multihost_utils.sync_global_devices("after the resume check")
print("agreed", flush=True)
"""


@pytest.mark.slow
def test_every_process_agrees_whether_a_run_has_a_checkpoint(tmp_path, env):
    script = tmp_path / "worker.py"
    script.write_text(RESUME_CHECK_WORKER)
    coordinator = f"127.0.0.1:{_free_port()}"
    logs = [tmp_path / f"process{i}.log" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, str(script), coordinator, str(i), str(tmp_path / "run")], cwd=ROOT,
                              env=dict(env, XLA_FLAGS=child_xla_flags(1)), text=True,
                              stdout=log.open("w"), stderr=subprocess.STDOUT)
             for i, log in enumerate(logs)]
    for p, log in zip(procs, logs, strict=True):
        try:
            assert p.wait(timeout=90) == 0, log.read_text()[-3000:]
        finally:
            p.kill()
    for log in logs:
        assert log.read_text().splitlines()[-2:] == ["state None", "agreed"]


def test_settings_from_env():
    assert distributed.settings_from_env({}) is None
    assert distributed.settings_from_env({"JGRPO_COORDINATOR": "10.0.0.2:8476", "JGRPO_NUM_PROCESSES": "4",
                                          "JGRPO_PROCESS_ID": "3"}) == ("10.0.0.2:8476", 4, 3)


@pytest.mark.parametrize("environ, message", [
    ({"JGRPO_COORDINATOR": "h:1"}, "JGRPO_NUM_PROCESSES, JGRPO_PROCESS_ID not set"),
    ({"JGRPO_COORDINATOR": "nohost", "JGRPO_NUM_PROCESSES": "2", "JGRPO_PROCESS_ID": "0"}, "not host:port"),
    ({"JGRPO_COORDINATOR": "h:1", "JGRPO_NUM_PROCESSES": "two", "JGRPO_PROCESS_ID": "0"}, "must be integers"),
    ({"JGRPO_COORDINATOR": "h:1", "JGRPO_NUM_PROCESSES": "2", "JGRPO_PROCESS_ID": "2"}, r"in \[0, "),
])
def test_settings_from_env_errors(environ, message):
    with pytest.raises(ValueError, match=message):
        distributed.settings_from_env(environ)


def test_single_process_needs_nothing():
    # No JGRPO_* variables and no Cloud TPU: no runtime is started, and the process count stays 1.
    assert distributed.initialize({}) == 1
    assert not jax.distributed.is_initialized()
    assert distributed.initialize({"JGRPO_COORDINATOR": "h:1", "JGRPO_NUM_PROCESSES": "1",
                                   "JGRPO_PROCESS_ID": "0"}) == 1


def _fake_bucket(root: Path):
    """epath with gs://bucket/... stored under `root`, refusing appends as a real object store does."""
    def local(path):
        return str(path).replace("gs://", f"{root}/", 1)

    def one(fn, path, *args, **kwargs):
        return fn(local(path), *args, **kwargs)

    def two(fn, path, dst, *args, **kwargs):
        return fn(local(path), local(dst), *args, **kwargs)

    def open_(fn, path, mode):
        if "a" in mode:
            raise OSError(f"object stores cannot append ({path})")
        return fn(local(path), mode)

    singles = ("exists", "glob", "isdir", "listdir", "makedirs", "mkdir", "remove", "rmtree", "stat", "walk")
    return mock_epath(open=open_, **dict.fromkeys(singles, one), **dict.fromkeys(("copy", "rename", "replace"), two))


def test_bucket_run_directory_config_and_metrics(tmp_path):
    """A gs:// run.output_dir: the config and the metrics go through epath (pathlib would turn gs:// into gs:/)."""
    run = "gs://bucket/runs/tiny"
    config = load_config(ROOT / "configs" / "tiny.yaml", [f"run.output_dir={run}"])
    logging_config = LoggingConfig(tensorboard=False, progress_bar=False)
    with _fake_bucket(tmp_path):
        save_config(config, config.run.output_dir)
        assert load_config(tmp_path / "bucket/runs/tiny/config.yaml").run.output_dir == run
        logger = MetricsLogger(run, logging_config, total_iterations=3, enabled=True)
        for it in (1, 2):
            logger.log(it, {"reward/mean": 0.5 * it})
            logger.log_samples(it, [{"completion": f"c{it}"}])
        logger.close()
        # Resumed from the checkpoint of iteration 1: the record of iteration 2 is dropped, 2 and 3 come anew.
        logger = MetricsLogger(run, logging_config, total_iterations=3, start_iteration=1, enabled=True)
        for it in (2, 3):
            logger.log(it, {"reward/mean": 0.25 * it})
        logger.close()
        assert read_metrics(run) == [{"iteration": 1, "reward/mean": 0.5}, {"iteration": 2, "reward/mean": 0.5},
                                     {"iteration": 3, "reward/mean": 0.75}]
        assert [r["completion"] for r in read_jsonl(epath.Path(run) / "samples.jsonl")] == ["c1"]
    assert (tmp_path / "bucket/runs/tiny/metrics.jsonl").is_file()
