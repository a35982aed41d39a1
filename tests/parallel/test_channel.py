"""The two-job channel (length-prefixed frames, heartbeats) and the bucketed weight transfer over it, on loopback."""

import dataclasses
import socket
import struct
import threading
import time
import tracemalloc
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jgrpo.parallel import channel as channel_module
from jgrpo.parallel.channel import ChannelClosed, Codec, Listener, connect, interface_toward
from jgrpo.parallel.weights.buckets import WeightsRefused, bucket_plan, receive_weights, send_weights
from jgrpo.parallel.weights.device_transfer import DeviceTransfer


@dataclasses.dataclass
class Record:
    name: str
    values: np.ndarray
    extra: dict


class Pair(NamedTuple):
    a: np.ndarray
    b: list


def _pair(codec=None):
    codec = codec or Codec()
    listener = Listener("127.0.0.1:0", codec)
    result = {}
    thread = threading.Thread(target=lambda: result.update(server=listener.accept(10)))
    thread.start()
    client = connect(f"127.0.0.1:{listener.port}", codec, wait_s=10)
    thread.join()
    listener.close()
    return result["server"], client


def test_messages_round_trip_with_arrays_and_registered_types():
    server, client = _pair(Codec(Record, Pair))
    bf16 = np.arange(6, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(2, 3)
    message = {"record": Record("r", np.array([[1, 2]], np.int32), {"k": (1, "x", None)}),
               "pair": Pair(bf16, [np.zeros(0, np.uint8), True, 2.5]), "jax": jnp.arange(3)}
    client.send("hello", message)
    kind, got = server.recv(timeout=10)
    assert kind == "hello"
    record = got["record"]
    assert isinstance(record, Record) and record.name == "r" and record.extra == {"k": (1, "x", None)}
    np.testing.assert_array_equal(got["record"].values, [[1, 2]])
    assert got["pair"].a.dtype == bf16.dtype and (got["pair"].a == bf16).all()
    assert got["pair"].b[0].shape == (0,) and got["pair"].b[1:] == [True, 2.5]
    np.testing.assert_array_equal(got["jax"], [0, 1, 2])
    client.close()
    with pytest.raises(ChannelClosed, match="closed the connection"):
        server.recv(timeout=10)


def test_an_unregistered_type_is_refused_at_both_ends():
    server, client = _pair(Codec(Record))
    with pytest.raises(TypeError, match="Pair cannot go over the channel"):
        client.send("x", Pair(np.zeros(1), []))
    # A peer naming a type this side does not know closes the channel: nothing is built from it.
    other = Codec(Record, Pair)
    client.codec = other
    client.send("x", Pair(np.zeros(1), []))
    with pytest.raises(ChannelClosed, match="unknown type 'Pair'"):
        server.recv(timeout=10)


@pytest.mark.parametrize("raw, why", [
    (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "a frame of"),  # a probe that is not a jgrpo job
    (struct.pack(">QI", 4 + 27 + 3, 27) + b'{"kind": "x", "body": null}' + b"abc", "3 bytes after the last array"),
    (struct.pack(">QI", 4 + 70, 70) + b'{"kind": "x", "body": {"__array__": 0, "dtype": "nope", "shape": [1]}}',
     "AttributeError"),
])
def test_a_malformed_frame_closes_the_channel_saying_why(raw, why):
    listener = Listener("127.0.0.1:0", Codec())
    peer = socket.create_connection(("127.0.0.1", listener.port))
    channel = listener.accept(10)
    peer.sendall(raw)
    with pytest.raises(ChannelClosed, match=f"sent a malformed message .*{why}"):
        channel.recv(timeout=10)
    peer.close()
    listener.close()


def test_heartbeats_keep_a_quiet_peer_alive_and_silence_closes(monkeypatch):
    monkeypatch.setattr(channel_module, "HEARTBEAT_S", 0.1)
    monkeypatch.setattr(channel_module, "SILENCE_S", 1.0)
    server, client = _pair()
    with pytest.raises(TimeoutError):  # nothing to say for 2 s, but alive: heartbeats are not messages
        server.recv(timeout=2)
    assert not server.is_closed
    # A peer that stops sending anything (a hung host: its socket stays open) is gone after SILENCE_S.
    listener = Listener("127.0.0.1:0", Codec())
    mute = socket.create_connection(("127.0.0.1", listener.port))
    quiet = listener.accept(10)
    start = time.monotonic()
    with pytest.raises(ChannelClosed, match="sent nothing for 1 s"):
        quiet.recv(timeout=10)
    assert time.monotonic() - start < 5
    mute.close()
    listener.close()


def test_connect_waits_for_the_listener_then_gives_up():
    port = Listener("127.0.0.1:0", Codec())
    free = port.port
    port.close()
    with pytest.raises(ChannelClosed, match=f"no trainer at 127.0.0.1:{free} after 1 s"):
        connect(f"127.0.0.1:{free}", Codec(), wait_s=1, retry_s=0.2)


def test_bucket_plan_cuts_leaves_into_rows():
    leaves = [np.zeros((15, 1), np.float32), np.zeros((0, 3), np.int8), np.zeros(7, np.int8),
              np.zeros((), np.float32), np.zeros((2, 20), np.float32)]
    plan = bucket_plan(leaves, 16)  # 4 float32 per bucket
    flat = [p for bucket in plan for p in bucket]
    assert flat[:4] == [(0, 0, 4), (0, 4, 8), (0, 8, 12), (0, 12, 15)]
    # Every bucket within 16 bytes, except those holding one row larger than a bucket (80 bytes).
    row_bytes = [4, 3, 1, 4, 80]
    assert all(sum((p.stop - p.start) * row_bytes[p.leaf] for p in b) <= 16 for b in plan if b[0].leaf != 4)
    assert [p for p in flat if p.leaf == 4] == [(4, 0, 1), (4, 1, 2)]
    covered = {i: sum(p.stop - p.start for p in flat if p.leaf == i) for i in range(5)}
    assert covered == {0: 15, 1: 0, 2: 7, 3: 1, 4: 2}


def _bits(x) -> np.ndarray:
    return np.asarray(x).reshape(-1).view(np.uint8)


@pytest.mark.parametrize("path", ["host", "jax"])
@pytest.mark.parametrize("bucket_bytes", [1 << 20, 1000])
def test_weights_arrive_bit_for_bit_in_the_receivers_sharding(bucket_bytes, path):
    # rollout.weight_transfer host (the pieces inside the frames) and jax (pulled device to device from the
    # sender's transfer server, the sender waiting for each bucket's "weights_pulled"): the same bits, laid out in
    # the receiver's sharding, whole buckets and a leaf split over several.
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))  # automatic axes, as jgrpo's meshes (mesh.py)
    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    key = jax.random.key(0)
    params = {"w": jax.random.normal(key, (64, 48), jnp.bfloat16), "q": {"values": jnp.arange(256, dtype=jnp.int8)
              .reshape(16, 16), "scale": jnp.linspace(0, 1, 16, dtype=jnp.float32)}, "b": jnp.zeros((8,), jnp.float32),
              "t": jnp.float32(2.5)}
    params["w"] = jax.device_put(params["w"], sharded)  # a piece of a sharded leaf is gathered before it goes
    shardings = {"w": sharded, "q": {"values": sharded, "scale": whole}, "b": whole, "t": whole}
    server, client = _pair()
    sending, receiving = (DeviceTransfer(), DeviceTransfer()) if path == "jax" else (None, None)
    acks = []

    def pulled(channel, bucket):
        kind, body = channel.recv(timeout=10)
        assert kind == "weights_pulled" and body == {"version": 3, "bucket": bucket}
        acks.append(bucket)

    result = {}
    thread = threading.Thread(target=lambda: result.update(sent=send_weights(
        [client], params, version=3, bucket_bytes=bucket_bytes, extra={"dropped": 1}, transfer=sending, pulled=pulled)))
    thread.start()
    kind, header = server.recv(timeout=10)
    assert kind == "weights" and header["version"] == 3 and header["extra"] == {"dropped": 1}
    got = receive_weights(server, header, params, shardings, timeout=10, transfer=receiving)
    thread.join()
    sent = result["sent"]
    for path_, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        y = got
        for k in path_:
            y = y[k.key]
        assert y.shape == x.shape and y.dtype == x.dtype and y.sharding == (sharded if y.ndim == 2 else whole)
        np.testing.assert_array_equal(_bits(y), _bits(x))
    assert sent["peak_bucket_bytes"] <= bucket_bytes and sent["bytes"] >= 6500
    # 6,500 bytes: whole rows per bucket (w's rows are 96 bytes: 10 of them in 1000 bytes)
    assert sent["buckets"] == (1 if bucket_bytes > 8000 else len(bucket_plan(jax.tree.leaves(params), 1000)))
    assert acks == (list(range(sent["buckets"])) if path == "jax" else [])


def test_a_receiver_without_a_transfer_server_refuses_device_to_device_weights():
    server, client = _pair()
    thread = threading.Thread(target=send_weights, args=([client], {"w": jnp.zeros((2, 3))}),
                              kwargs={"version": 0, "bucket_bytes": 1 << 20, "transfer": DeviceTransfer(),
                                      "pulled": lambda channel, bucket: None})
    thread.start()
    _, header = server.recv(timeout=10)
    thread.join()
    with pytest.raises(WeightsRefused, match="rollout.weight_transfer: jax"):
        receive_weights(server, header, {"w": jnp.zeros((2, 3))}, {"w": None})


def test_weights_go_to_several_receivers_and_one_gone_leaves_the_others_theirs():
    """A trainer process serving several rollout processes: each gets every bucket; one whose channel breaks on
    the way is dropped, the send goes on to the others and says so at the end; one closed before is skipped."""
    params = {"w": jnp.arange(48, dtype=jnp.float32).reshape(8, 6), "b": jnp.ones((3,), jnp.bfloat16)}
    (server_a, client_a), (_, client_b), (server_c, client_c), (_, client_d) = _pair(), _pair(), _pair(), _pair()
    client_d.close()
    real_send = client_b.send

    def breaks_at_the_first_bucket(kind, body=None):
        if kind == "weights_bucket":
            client_b.close("the connection broke")
        return real_send(kind, body)

    client_b.send = breaks_at_the_first_bucket
    result = {}

    def send():
        try:
            send_weights([client_a, client_b, client_c, client_d], params, version=1, bucket_bytes=64)
        except ChannelClosed as e:
            result["lost"] = e

    thread = threading.Thread(target=send)
    thread.start()
    for server in (server_a, server_c):
        _, header = server.recv(timeout=10)
        got = receive_weights(server, header, params, jax.tree.map(lambda x: x.sharding, params), timeout=10)
        for key in params:
            np.testing.assert_array_equal(_bits(got[key]), _bits(params[key]))
    thread.join()
    assert "lost" in result


def test_weights_for_other_params_are_refused_naming_the_leaf():
    server, client = _pair()
    send_weights([client], {"w": jnp.zeros((2, 3), jnp.bfloat16)}, version=0, bucket_bytes=1 << 20)
    _, header = server.recv(timeout=10)
    with pytest.raises(WeightsRefused, match=r"\['w'\]: this job expects \[2, 3\] float32"):
        receive_weights(server, header, {"w": jnp.zeros((2, 3), jnp.float32)}, {"w": None})


def test_host_memory_stays_within_a_few_buckets():
    params = {f"l{i}": jnp.full((256, 256), i, jnp.float32) for i in range(16)}  # 4 MiB, 256 KiB a leaf
    bucket = 64 << 10  # each leaf split over 4 buckets
    server, client = _pair()
    tracemalloc.start()
    try:
        thread = threading.Thread(target=send_weights, args=([client], params),
                                  kwargs={"version": 0, "bucket_bytes": bucket})
        thread.start()
        _, header = server.recv(timeout=10)
        got = receive_weights(server, header, params, jax.tree.map(lambda x: x.sharding, params), timeout=10)
        thread.join()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert all(float(got[f"l{i}"][3, 7]) == i for i in range(16))
    # Sender and receiver in one process: a bucket being read, one being sent, a few queued. 4 MiB in all.
    assert peak < 8 * bucket, f"host peak {peak} bytes for buckets of {bucket}"


def test_the_interface_toward_a_peer_is_the_one_its_traffic_leaves_by():
    # What a trainer process > 0 advertises to its rollout peer. gethostbyname(gethostname()) is a loopback address
    # on many hosts (127.0.0.1 on this project's machines, 127.0.1.1 on Debian's defaults), which a peer on another
    # host cannot reach; the interface the route to the peer leaves by is not.
    assert interface_toward("127.0.0.1", 9) == "127.0.0.1"
    toward = interface_toward("10.255.255.1", 9)
    socket.inet_aton(toward)
    assert not toward.startswith("127."), toward
