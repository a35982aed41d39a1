"""One job split across processes: `mesh.rollout_devices` gives the sampler whole processes (the last ones).

In CI: the split's config errors, and the weights crossing from the trainer's processes to the sampler's
(`parallel/weights/process_crossing.py`) bit for bit, repeatedly (JAX's cross-host `device_put` hung on the second
12.6 MB transfer on CPU; the crossing is a collective). Under `pod` (python -m pytest tests -m pod): whole runs of 2 and
3 processes, saved and resumed, against one process with the same split.
"""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from jgrpo.config import ConfigError
from jgrpo.parallel.mesh import check_process_split
from jgrpo.training.metrics_log import read_metrics
from tests.helpers import ROOT, child_xla_flags
from tests.parallel.test_multihost import _free_port, _params


@pytest.mark.parametrize("n, per_process, total, message", [
    (3, 2, 8, r"mesh.rollout_devices=3 is not a multiple of the 2 devices per process"),
    (4, 2, 10, r"mesh.rollout_devices=4 leaves 6 devices for the trainer, not a multiple of the sampler's 4"),
])
def test_the_sampler_gets_whole_processes_and_the_trainer_a_multiple(n, per_process, total, message):
    with pytest.raises(ConfigError, match=message):
        check_process_split(n, per_process, total)
    check_process_split(4, 2, 12)  # 2 of 6 processes sample, 4 train


# Each process of the job runs this: the trainer's params (4 devices on processes 0-1: 2 copies of the sampler's
# layout) cross to the sampler (process 2's 2 devices) as bfloat16, three times with other values, and a kept
# twin crosses twice (not consumed). The sampler's process prints what it received.
WORKER = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(sys.argv[1], 3, int(sys.argv[2]))
from jgrpo.parallel.weights.copies import param_copier
from jgrpo.parallel.weights.process_crossing import ProcessCrossing
devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
trainer = Mesh(np.array(devices[:4]).reshape(4, 1), ("fsdp", "tensor"))
sampler = Mesh(np.array(devices[4:]).reshape(2, 1), ("fsdp", "tensor"))
make = jax.jit(lambda k: {"w": (jnp.arange(3 << 20, dtype=jnp.float32).reshape(3 << 10, 1 << 10) % 1000) * 0.25 + k,
                          "b": jnp.arange(8, dtype=jnp.float32) - k},
               out_shardings={"w": NamedSharding(trainer, P("fsdp")), "b": NamedSharding(trainer, P())})
target = {"w": NamedSharding(sampler, P(None, "fsdp")), "b": NamedSharding(sampler, P())}
cross = param_copier(target, lambda p: jax.tree.map(lambda x: x.astype(jnp.bfloat16), p), source=trainer)
assert isinstance(cross, ProcessCrossing)
def local(tree):
    return {k: [np.asarray(s.data.astype(jnp.float32)).tolist() for s in sorted(
        x.addressable_shards, key=lambda s: s.device.id)] for k, x in tree.items()}
got = [cross(make(float(k))) for k in range(3)]
twin = cross.twin(make(5.0))
got += [cross.send(twin), cross.send(twin)]
for tree in got:
    for name, x in tree.items():
        assert x.sharding == target[name] and x.dtype == jnp.bfloat16
if jax.process_index() == 2:
    print(json.dumps([local(tree) for tree in got]))
"""


@pytest.mark.slow
def test_weights_cross_from_the_trainers_processes_to_the_samplers_bit_for_bit(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {k: v for k, v in os.environ.items() if not k.startswith("JGRPO_")}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=child_xla_flags(2),
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    coordinator = f"127.0.0.1:{_free_port()}"
    logs = [tmp_path / f"process{i}.log" for i in range(3)]  # files: a full pipe would stall its process
    procs = [subprocess.Popen([sys.executable, str(script), coordinator, str(i)], env=env, text=True,
                              stdout=log.open("w"), stderr=(tmp_path / f"process{i}.err").open("w"))
             for i, log in enumerate(logs)]
    for i, p in enumerate(procs):
        assert p.wait(timeout=300) == 0, (tmp_path / f"process{i}.err").read_text()[-3000:]
    received = json.loads(logs[2].read_text().strip().splitlines()[-1])
    for k, tree in zip([0, 1, 2, 5, 5], received, strict=True):
        w = ((np.arange(3 << 20, dtype=np.float32).reshape(3 << 10, 1 << 10) % 1000) * 0.25 + k).astype("bfloat16")
        want_w = np.split(np.asarray(w, np.float32), 2, axis=1)  # the sampler's layout: columns over its 2 devices
        assert [np.asarray(s, np.float32).tobytes() for s in tree["w"]] == [x.tobytes() for x in want_w]
        assert tree["b"] == [list(np.arange(8, dtype=np.float32) - k)] * 2


# Whole runs: the tiny config with a reward that has spread (tests/parallel/test_multihost.py), each process with
# 2 CPU devices, the sampler on the last process.
OVERRIDES = ["reward.functions=[tests.helpers:space_fraction]", "logging.samples_every=0", "checkpoint.every=2",
             "mesh.rollout_devices=2"]


def _run(run_dir, iterations, processes, *overrides):
    """`python -m jgrpo.train` as `processes` processes of 2 devices (1: one process of 2 x the job's devices)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JGRPO_")}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "jgrpo.train", "configs/tiny.yaml", f"run.output_dir={run_dir}",
           f"run.iterations={iterations}", *OVERRIDES, *overrides]
    if isinstance(processes, tuple):  # (one process, its devices)
        return [subprocess.Popen(cmd, cwd=ROOT, env=dict(env, XLA_FLAGS=child_xla_flags(processes[1])),
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)]
    coordinator = f"127.0.0.1:{_free_port()}"
    return [subprocess.Popen(cmd, cwd=ROOT, env=dict(env, XLA_FLAGS=child_xla_flags(2),
                                                     JGRPO_COORDINATOR=coordinator,
                                                     JGRPO_NUM_PROCESSES=str(processes), JGRPO_PROCESS_ID=str(i)),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(processes)]


def _finish(procs):
    for proc in procs:
        out, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0, out[-4000:]


@pytest.mark.pod
@pytest.mark.slow
@pytest.mark.parametrize("processes, overrides, atol", [
    (2, [], 0.0),  # 1 + 1, v = 1: bit for bit
    (2, ["grpo.behaviour_refresh=2", "rollout.mode=window"], 0.0),  # saved inside a window of 2
    # 1 + 2 hosts: the two trainer processes sum in another order than one process, and Adam turns a gradient entry
    # that is ~0 up to rounding into a step of up to lr: eps 1e-5 (not 1e-8) keeps such steps small (seen: one
    # embedding entry 1.8e-5 apart at eps 1e-8), as in tests/parallel/test_multihost.py.
    (3, ["grpo.behaviour_refresh=2", "sampler.weights_dtype=int8", "data.batch_size=6", "optim.eps=1e-5"], 1e-5),
], ids=["sync_1+1", "window_1+1", "v2_int8_1+2"])
def test_a_job_split_across_processes_saves_resumes_and_trains_as_one_process(tmp_path, processes, overrides, atol):
    split, one = tmp_path / "split", tmp_path / "one"
    reference = _run(one, 5, (1, 2 * processes), *overrides)  # alongside: the same split in one process
    _finish(_run(split, 3, processes, *overrides))
    _finish(_run(split, 5, processes, *overrides))  # resumed from iteration 3 (window: inside one)
    _finish(reference)
    for got, want in zip(read_metrics(split), read_metrics(one), strict=True):
        assert got["iteration"] == want["iteration"]
        np.testing.assert_allclose(got["reward/mean"], want["reward/mean"], rtol=1e-6)
        np.testing.assert_allclose(got["loss/loss"], want["loss/loss"], rtol=0, atol=max(atol, 1e-9))
    got, want = _params(split, 5), _params(one, 5)
    leaves = jax.tree.leaves_with_path(want)
    assert len(leaves) == len(jax.tree.leaves(got)) > 0
    for (path, w), g in zip(leaves, jax.tree.leaves(got), strict=True):
        np.testing.assert_allclose(g, w, rtol=0, atol=atol, err_msg=jax.tree_util.keystr(path))
