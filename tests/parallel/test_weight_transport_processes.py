"""The weights between two jobs of several processes each (`-m pod`, not in CI): 2 trainer processes (one
`jax.distributed` world, the params split over both) publish 50 versions of a training run to 2 rollout processes
(another world, its own layout), each trainer process to its rollout peer, whole and as changes, bf16 and int8.
Here the trainer's changes and fingerprints are collectives of its world (the device path: leaves span two
processes), the rollout processes place and change only their own shards, and each checks what it holds against
the same run computed on its own, bit for bit. One process per side: tests/parallel/test_weight_transport.py."""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT, child_xla_flags
from tests.parallel.test_multihost import _free_port

WORKER = """
import json, sys, threading
import jax, jax.numpy as jnp, numpy as np, optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
jax.config.update("jax_cpu_collectives_implementation", "gloo")
role, coordinator, index, port, delta, dtype = sys.argv[1:]
index, port = int(index), int(port)
jax.distributed.initialize(coordinator, 2, index)
from jgrpo.models.quantize import sampler_copy
from jgrpo.parallel.channel import Codec, Listener, connect
from jgrpo.parallel.weights.receive import WeightReceiver
from jgrpo.parallel.weights.send import WeightSender

mesh = Mesh(np.array(sorted(jax.devices(), key=lambda d: d.process_index)), ("x",))
rows, columns, whole = (NamedSharding(mesh, P(*spec)) for spec in (["x"], [None, "x"], []))
params = {"embed": jax.device_put(jax.random.normal(jax.random.key(0), (256, 32)) * 0.02, rows),
          "layers": {"q": jax.device_put(jax.random.normal(jax.random.key(1), (2, 32, 64)) * 0.02, whole),
                     "attn_norm": jax.device_put(jnp.ones((2, 32)), whole)},
          "final_norm": jax.device_put(jnp.ones((32,)), whole)}
optimizer = optax.adam(1e-5)
state = optimizer.init(params)
copy = jax.jit(sampler_copy(dtype, "bfloat16"))
step = jax.jit(lambda p, s, k: (lambda u: (optax.apply_updates(p, u[0]), u[1]))(optimizer.update(jax.tree.map(
    lambda x, kk: jax.random.normal(kk, x.shape) * 0.1 + x * 0.01, p,
    jax.tree.unflatten(jax.tree.structure(p), list(jax.random.split(k, len(jax.tree.leaves(p)))))), s)))
versions = []
for i in range(50):
    versions.append(copy(params))
    params, state = step(params, state, jax.random.key(100 + i))

def bits(x):
    shards = sorted(x.addressable_shards, key=lambda s: s.device.id)
    return [np.asarray(s.data).reshape(-1).view(np.uint8) for s in shards]

if role == "trainer":
    channel = connect(f"127.0.0.1:{port + index}", Codec(), wait_s=120)
    def answer(ch, kind, version, bucket):
        got, body = ch.recv(timeout=300)
        assert got == kind and body["version"] == version, (got, body)
        return body
    sender = WeightSender(bucket_bytes=4096, delta=delta, answer=answer)
    kinds = [sender.publish([channel], v, i, rollouts=2)["kind"] for i, v in enumerate(versions)]
    print(json.dumps({"kinds": kinds, "mismatches": sender.mismatches}))
else:
    listener = Listener(f"127.0.0.1:{port + index}", Codec())
    channel = listener.accept(120)
    # The rollout job's own layout: the embedding by columns, the rest replicated.
    shardings = jax.tree.map(lambda x: whole, versions[0]) | {"embed": columns}
    receiver = WeightReceiver(versions[0], shardings)
    held, wrong = 0, []
    while held < 50:
        _, header = channel.recv(timeout=300)
        got = receiver.receive(channel, header, timeout=300)
        if got is None:
            continue
        want = jax.device_put(versions[header["version"]], shardings)
        wrong += [header["version"] for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want))
                  if not all(np.array_equal(a, b) for a, b in zip(bits(g), bits(w)))]
        receiver.refill_spares()
        held += 1
    print(json.dumps({"wrong": sorted(set(wrong)), "refused": receiver.refused}))
"""


@pytest.mark.pod
@pytest.mark.slow
@pytest.mark.parametrize("weights_dtype", ["bfloat16", "int8"])
@pytest.mark.parametrize("delta", ["never", "always"])
def test_fifty_publishes_between_two_jobs_of_two_processes_arrive_bit_for_bit(tmp_path, delta, weights_dtype):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = _free_port()
    worlds = {role: f"127.0.0.1:{_free_port()}" for role in ("trainer", "rollout")}
    env = {k: v for k, v in os.environ.items() if not k.startswith("JGRPO_")}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=child_xla_flags(1),
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    procs = {(role, i): subprocess.Popen(
        [sys.executable, str(script), role, worlds[role], str(i), str(port), delta, weights_dtype], cwd=ROOT,
        env=env, stdout=(tmp_path / f"{role}{i}.out").open("w"), stderr=(tmp_path / f"{role}{i}.err").open("w"))
        for role in ("rollout", "trainer") for i in range(2)}
    for (role, i), proc in procs.items():
        assert proc.wait(timeout=900) == 0, (tmp_path / f"{role}{i}.err").read_text()[-3000:]
    out = {key: json.loads((tmp_path / f"{key[0]}{key[1]}.out").read_text().strip().splitlines()[-1]) for key in procs}
    for i in range(2):
        assert out[("rollout", i)] == {"wrong": [], "refused": 0}
        assert out[("trainer", i)]["mismatches"] == 0
        assert out[("trainer", i)]["kinds"] == ["whole"] + ["changes" if delta == "always" else "whole"] * 49
