"""The two-job channel (length-prefixed frames, heartbeats, reused receive buffers) and the weights' bucket plan, on
loopback. The weights over it: tests/parallel/test_weight_transport.py."""

import dataclasses
import socket
import struct
import threading
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jgrpo.parallel import channel as channel_module
from jgrpo.parallel.channel import ChannelClosed, Codec, Listener, connect, interface_toward
from jgrpo.parallel.weights.buckets import bucket_plan


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


def test_a_frames_arrays_are_aligned_and_its_buffer_is_reused_only_once_nothing_views_it():
    """The arrays of a frame start at multiples of ALIGN (on CPU `device_put` then takes them without a copy) and
    a received buffer comes back to the channel once no array views it, including a jax CPU array that aliases it."""
    server, client = _pair()
    size = 2 << 20  # kept buffers start at 1 MiB
    client.send("bucket", {"a": np.arange(3, dtype=np.int8), "b": np.ones(size // 4, np.float32)})
    _, first = server.recv(timeout=10)
    assert all(a.ctypes.data % channel_module.ALIGN == 0 for a in first.values())
    on_device = jax.device_put(first["b"])  # aliases the frame's memory (CPU)
    pointer = first["b"].ctypes.data
    del first
    client.send("bucket", {"a": np.arange(3, dtype=np.int8), "b": np.full(size // 4, 2, np.float32)})
    _, second = server.recv(timeout=10)
    assert second["b"].ctypes.data != pointer  # still in use by the device array: not reused
    assert float(on_device[0]) == 1.0 and float(second["b"][0]) == 2.0
    del on_device, second
    client.send("bucket", {"a": np.arange(3, dtype=np.int8), "b": np.full(size // 4, 3, np.float32)})
    _, third = server.recv(timeout=10)
    assert float(third["b"][-1]) == 3.0
    assert third["b"].ctypes.data % channel_module.ALIGN == 0


def test_the_interface_toward_a_peer_is_the_one_its_traffic_leaves_by():
    # What a trainer process > 0 advertises to its rollout peer. gethostbyname(gethostname()) is a loopback address
    # on many hosts (127.0.0.1 on this project's machines, 127.0.1.1 on Debian's defaults), which a peer on another
    # host cannot reach; the interface the route to the peer leaves by is not.
    assert interface_toward("127.0.0.1", 9) == "127.0.0.1"
    toward = interface_toward("10.255.255.1", 9)
    socket.inet_aton(toward)
    assert not toward.startswith("127."), toward
