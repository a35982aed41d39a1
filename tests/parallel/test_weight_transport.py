"""The weights between two jobs (`parallel/weights/send.py`, `receive.py`): whole copies and changes over a loopback
channel, in one process (the sender in a thread), bit for bit, checked by fingerprint, healed when a change is
lost or corrupted. Several processes per side: tests/parallel/test_weight_transport_processes.py."""

import threading
import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jgrpo.models.hf import load_model
from jgrpo.models.quantize import sampler_copy
from jgrpo.parallel.channel import ChannelClosed, Codec, Listener, connect
from jgrpo.parallel.weights import changes as changes_module
from jgrpo.parallel.weights.buckets import WeightsRefused, bucket_plan
from jgrpo.parallel.weights.device_transfer import DeviceTransfer
from jgrpo.parallel.weights.receive import WeightReceiver
from jgrpo.parallel.weights.send import WeightSender


def _pair():
    listener = Listener("127.0.0.1:0", Codec())
    result = {}
    thread = threading.Thread(target=lambda: result.update(server=listener.accept(10)))
    thread.start()
    client = connect(f"127.0.0.1:{listener.port}", Codec(), wait_s=10)
    thread.join()
    listener.close()
    return result["server"], client


def _answer(channel, kind, version, bucket):
    got, body = channel.recv(timeout=120)
    assert got == kind and body["version"] == version and body.get("bucket", bucket) == bucket, (got, body)
    return body


class Link:
    """A sender (the trainer's side, run in a thread per publish) and a receiver over one loopback channel."""

    def __init__(self, like, shardings, *, bucket_bytes=1 << 20, delta="always", transfer=False):
        self.server, self.client = _pair()
        self.sender = WeightSender(bucket_bytes=bucket_bytes, delta=delta, answer=_answer,
                                   transfer=DeviceTransfer() if transfer else None)
        self.receiver = WeightReceiver(like, shardings, transfer=DeviceTransfer() if transfer else None)

    def publish(self, params, version, tamper=None):
        """(the sender's stats, the receiver's params): the receiver reads until it holds a version."""
        out = {}
        thread = threading.Thread(target=lambda: out.update(stats=self.sender.publish(
            [self.client], params, version, rollouts=1, extra={"dropped": 1}, tamper=tamper)))
        thread.start()
        got = None
        while got is None:
            _, header = self.server.recv(timeout=120)
            got = self.receiver.receive(self.server, header, timeout=120)
        thread.join()
        self.receiver.refill_spares()
        return out["stats"], got


def _bits(x) -> np.ndarray:
    return np.asarray(x).reshape(-1).view(np.uint8)


def assert_same_bits(got, want):
    for (path, w), g in zip(jax.tree_util.tree_flatten_with_path(want)[0], jax.tree.leaves(got), strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(_bits(g), _bits(w), err_msg=jax.tree_util.keystr(path))


def _mesh():
    return jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))  # automatic axes, as jgrpo's meshes


def _sharded(spec):
    return jax.sharding.NamedSharding(_mesh(), jax.sharding.PartitionSpec(*spec))


@pytest.mark.parametrize("transfer", [False, True], ids=["host", "jax"])
@pytest.mark.parametrize("bucket_bytes", [1 << 20, 1000])
def test_a_whole_copy_arrives_bit_for_bit_in_the_receivers_sharding(bucket_bytes, transfer):
    # Whole buckets and leaves split over several; rows sharded on the sender, columns (or nothing) on the receiver;
    # the pieces inside the frames, or pulled device to device (then each bucket is answered "weights_pulled").
    key = jax.random.key(0)
    params = {"w": jax.device_put(jax.random.normal(key, (64, 48), jnp.bfloat16), _sharded(["x"])),
              "q": {"values": jnp.arange(256, dtype=jnp.int8).reshape(16, 16),
                    "scale": jnp.linspace(0, 1, 16, dtype=jnp.float32)},
              "b": jnp.zeros((8,), jnp.float32), "t": jnp.float32(2.5)}
    shardings = {"w": _sharded([None, "x"]), "q": {"values": _sharded(["x"]), "scale": _sharded([])},
                 "b": _sharded([]), "t": _sharded([])}
    link = Link(params, shardings, bucket_bytes=bucket_bytes, transfer=transfer)
    stats, got = link.publish(params, 3)
    assert_same_bits(got, params)
    assert jax.tree.map(lambda x: x.sharding.spec, got) == jax.tree.map(lambda s: s.spec, shardings)
    assert stats["kind"] == "whole" and stats["verified"] and stats["peak_bucket_bytes"] <= max(bucket_bytes, 96)
    assert stats["buckets"] == (1 if bucket_bytes > 8000 else len(bucket_plan(jax.tree.leaves(params), 1000)))
    assert link.receiver.held.version == 3 and link.sender.base.version == 3


def _training_run(weights_dtype: str, publishes: int):
    """The tiny Llama's params (its first 512 vocabulary rows), rows of the embedding sharded over 2 devices,
    and `publishes` versions of the sampler's copy (`sampler.weights_dtype`, compute dtype bfloat16; int8: values
    and scales) along as many Adam steps at lr 1e-5 on gradients of a fixed pull plus noise."""
    _, params, _ = load_model("tiny-random-llama")
    params = {**jax.device_put(params, _sharded([])), "embed": jax.device_put(params["embed"][:512], _sharded(["x"]))}
    optimizer = optax.adam(1e-5)
    state = optimizer.init(params)
    copy = jax.jit(sampler_copy(weights_dtype, "bfloat16"))

    @jax.jit
    def step(params, state, key):
        keys = iter(jax.random.split(key, len(jax.tree.leaves(params))))
        grads = jax.tree.map(lambda p: jax.random.normal(next(keys), p.shape) * 0.1 + p * 0.01, params)
        updates, state = optimizer.update(grads, state)
        return optax.apply_updates(params, updates), state

    for i in range(publishes):
        yield copy(params)
        params, state = step(params, state, jax.random.key(i))


@pytest.mark.parametrize("weights_dtype", ["bfloat16", "int8"])
@pytest.mark.parametrize("delta", ["never", "always"])
def test_fifty_publishes_of_a_training_run_arrive_bit_for_bit(delta, weights_dtype):
    versions = _training_run(weights_dtype, 50)
    first = next(versions)
    # The receiver lays the embedding out by columns: changes and pieces land in another layout than they left.
    shardings = jax.tree.map(lambda x: _sharded([]), first) | {"embed": _sharded([None, "x"])}
    link = Link(first, shardings, bucket_bytes=256 << 10, delta=delta)
    kinds, fractions = [], []
    for version, params in enumerate([first, *versions]):
        stats, got = link.publish(params, version)
        assert_same_bits(got, params)
        kinds.append(stats["kind"])
        fractions.append(stats["changed_fraction"])
    assert kinds == ["whole"] * (1 if delta == "always" else 50) + ["changes"] * (49 if delta == "always" else 0)
    assert link.sender.mismatches == link.receiver.refused == 0
    if delta == "always":  # a few percent of the elements cross a rounding boundary at each step
        assert 0 < np.median(fractions[1:]) < 0.5, fractions


@pytest.mark.parametrize("mishap", ["corrupted", "dropped"])
def test_a_change_lost_or_corrupted_on_the_way_is_caught_and_healed_by_a_whole_copy(mishap):
    versions = list(_training_run("bfloat16", 4))
    link = Link(versions[0], jax.tree.map(lambda x: x.sharding, versions[0]), bucket_bytes=64 << 10)
    link.publish(versions[0], 0)
    link.publish(versions[1], 1)

    def tamper(bucket):  # the test's hook: one bucket of the changes goes wrong on the way
        if bucket["values"] and not tamper.done:
            tamper.done = True
            if mishap == "corrupted":
                values = bucket["values"][0].copy()
                values[len(values) // 2] = -values[len(values) // 2]
                bucket["values"][0] = values
            else:
                del bucket["changed"][0], bucket["indices"][0], bucket["values"][0]

    tamper.done = False
    stats, got = link.publish(versions[2], 2, tamper=tamper)
    assert tamper.done and stats["kind"] == "whole" and stats["changed_fraction"] > 0
    assert link.sender.mismatches == link.receiver.refused == 1  # caught by the fingerprint, counted
    assert_same_bits(got, versions[2])
    stats, got = link.publish(versions[3], 3)  # and changes again from there
    assert stats["kind"] == "changes"
    assert_same_bits(got, versions[3])


def test_changes_onto_another_version_than_the_rollout_job_holds_are_refused_and_sent_whole():
    versions = list(_training_run("bfloat16", 3))
    link = Link(versions[0], jax.tree.map(lambda x: x.sharding, versions[0]))
    link.publish(versions[0], 0)
    link.publish(versions[1], 1)
    link.receiver.held = link.receiver.held._replace(version=7)  # (as a rollout job that missed a publish)
    stats, got = link.publish(versions[2], 2)
    assert stats["kind"] == "whole" and link.sender.mismatches == 1
    assert_same_bits(got, versions[2])


def test_weights_go_to_several_receivers_and_one_gone_leaves_the_others_theirs():
    """A trainer process serving several rollout processes: each gets every bucket; one whose channel breaks on
    the way is dropped and the send goes on to the others; one closed before is skipped. Not every rollout process
    answered: the version is not confirmed (the next publish is whole)."""
    params = {"w": jnp.arange(48, dtype=jnp.float32).reshape(8, 6), "b": jnp.ones((3,), jnp.bfloat16)}
    (server_a, client_a), (_, client_b), (server_c, client_c), (_, client_d) = _pair(), _pair(), _pair(), _pair()
    client_d.close()
    real_send = client_b.send

    def breaks_at_the_first_bucket(kind, body=None):
        if kind == "weights_bucket":
            client_b.close("the connection broke")
        return real_send(kind, body)

    client_b.send = breaks_at_the_first_bucket
    sender = WeightSender(bucket_bytes=64, delta="always", answer=_answer)
    result = {}
    thread = threading.Thread(target=lambda: result.update(stats=sender.publish(
        [client_a, client_b, client_c, client_d], params, 1, rollouts=4)))
    thread.start()
    got = {}

    def receive(server):
        _, header = server.recv(timeout=10)
        receiver = WeightReceiver(params, jax.tree.map(lambda x: x.sharding, params))
        got[server] = (receiver.receive(server, header, timeout=10), receiver)

    receivers = [threading.Thread(target=receive, args=(server,)) for server in (server_a, server_c)]
    for t in receivers:
        t.start()
    for t in [*receivers, thread]:
        t.join()
    assert not result["stats"]["verified"] and sender.base is None
    for params_got, receiver in got.values():  # each got every bucket; the verdict: not every process holds it
        assert params_got is None and receiver.refused == 1


def test_weights_for_other_params_are_refused_naming_the_leaf():
    server, client = _pair()
    thread = threading.Thread(target=lambda: WeightSender(bucket_bytes=1 << 20).publish(
        [client], {"w": jnp.zeros((2, 3), jnp.bfloat16)}, 0, rollouts=1))
    thread.start()
    _, header = server.recv(timeout=10)
    with pytest.raises(WeightsRefused, match=r"\['w'\]: this job expects \[2, 3\] float32"):
        WeightReceiver({"w": jnp.zeros((2, 3), jnp.float32)}, {"w": _sharded([])}).receive(server, header)
    server.close()
    thread.join()


def test_a_receiver_without_a_transfer_server_refuses_device_to_device_weights():
    server, client = _pair()
    params = {"w": jnp.zeros((2, 3))}
    sender = WeightSender(bucket_bytes=1 << 20, transfer=DeviceTransfer(), answer=_answer)
    thread = threading.Thread(target=lambda: sender.publish([client], params, 0, rollouts=1))
    thread.start()
    _, header = server.recv(timeout=10)
    with pytest.raises(WeightsRefused, match="rollout.weight_transfer: jax"):
        WeightReceiver(params, {"w": _sharded([])}).receive(server, header)
    server.close()
    thread.join()


def test_host_memory_stays_within_a_few_buckets_beyond_the_weights():
    """Sender and receiver in one process, 4 MiB of params in buckets of 64 KiB. On CPU the received frames are
    the new params' device buffers (aliased, not copied): what the host holds beyond those is the staging, a
    bucket being read and one being placed on the receiver's side, one read ahead and one sent on the sender's."""
    params = {f"l{i}": jnp.full((256, 256), i, jnp.float32) for i in range(16)}  # 256 KiB a leaf: 4 buckets each
    bucket = 64 << 10
    link = Link(params, jax.tree.map(lambda x: x.sharding, params), bucket_bytes=bucket, delta="never")
    link.publish(params, 0)  # (programs compiled, buffers made)
    tracemalloc.start()
    try:
        _, got = link.publish(params, 1)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert all(float(got[f"l{i}"][3, 7]) == i for i in range(16))
    weights = sum(x.nbytes for x in jax.tree.leaves(params))
    assert peak < weights + 8 * bucket, f"host peak {peak} bytes for {weights} of weights in buckets of {bucket}"


def _three_versions():
    """Leaves of each kind a sampler copy has (bf16 rows over 2 devices, a 3-D bf16 leaf, int8 values and their
    float32 scales, a scalar), in three versions a few percent apart."""
    key = jax.random.key(1)
    first = {"embed": jax.device_put(jax.random.normal(key, (64, 32), jnp.bfloat16), _sharded(["x"])),
             "stack": jax.device_put(jax.random.normal(key, (2, 16, 24), jnp.bfloat16), _sharded([])),
             "values": jax.device_put(jax.random.randint(key, (32, 32), -127, 127, jnp.int8), _sharded([None, "x"])),
             "scale": jax.device_put(jax.random.uniform(key, (32,)), _sharded([])),
             "step": jax.device_put(jnp.float32(1.0), _sharded([]))}
    def moved(x, key):  # 5% of the elements one step further (the scalar always)
        return jnp.where((jax.random.uniform(key, x.shape) < 0.05) | (x.ndim == 0), (x + 1).astype(x.dtype), x)

    versions = [first]
    for i in range(2):
        keys = dict(zip(first, jax.random.split(jax.random.key(2 + i), len(first)), strict=True))
        versions.append({name: moved(x, keys[name]) for name, x in versions[-1].items()})
    return versions


def test_the_device_path_finds_and_applies_the_same_changes_as_the_host_path(monkeypatch):
    # On CPU numpy reads the device buffers in place; on an accelerator (or leaves over several processes) jitted
    # programs find the changes (padded: one program per size) and write them into device spares. Both here.
    versions = _three_versions()
    found = {path: changes_module.leaf_changes(new, old) for (path, new), old in
             zip(jax.tree_util.tree_flatten_with_path(versions[2])[0], jax.tree.leaves(versions[1]), strict=True)}
    monkeypatch.setattr(changes_module, "on_host", lambda x: False)
    device = Link(versions[0], jax.tree.map(lambda x: x.sharding, versions[0]))
    kinds = [device.publish(params, version)[0]["kind"] for version, params in enumerate(versions)]
    assert kinds == ["whole", "changes", "changes"]
    assert_same_bits(device.receiver.held.params, versions[2])
    assert sum(len(c.indices) for c in found.values()) > 100
    for (path, new), old in zip(jax.tree_util.tree_flatten_with_path(versions[2])[0], jax.tree.leaves(versions[1]),
                                strict=True):
        on_device = changes_module.leaf_changes(new, old)
        np.testing.assert_array_equal(np.sort(on_device.indices), np.sort(found[path].indices))
        order, host_order = np.argsort(on_device.indices), np.argsort(found[path].indices)
        np.testing.assert_array_equal(_bits(on_device.values[order]), _bits(found[path].values[host_order]))
        assert on_device.fingerprint == found[path].fingerprint


def test_a_receiver_closed_mid_publish_is_said_to_the_sender():
    params = {"w": jnp.zeros((64, 64), jnp.float32)}
    server, client = _pair()
    sender = WeightSender(bucket_bytes=1024, answer=_answer)
    thread = threading.Thread(target=lambda: sender.publish([client], params, 0, rollouts=1))
    thread.start()
    server.recv(timeout=10)
    server.close()
    thread.join()
    assert sender.base is None
    with pytest.raises(ChannelClosed):
        client.recv(timeout=10)
