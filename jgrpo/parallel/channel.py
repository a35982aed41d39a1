"""A TCP channel between two jobs: length-prefixed frames, a reader thread, heartbeats both ways.

The two-job mode (`rollout.role: trainer|rollout`) joins two separate `jax.distributed` worlds with nothing but
this socket: records flow one way, weights the other. A frame is

    8 bytes   big-endian length of the rest
    4 bytes   big-endian length of the header
    header    UTF-8 JSON: {"kind": ..., "body": the message with every array replaced by a reference}
    arrays    the arrays' raw bytes, one after another (their dtype and shape are in the header), each starting
              at a multiple of `ALIGN` bytes from the header's start (zero bytes pad the gaps)

so a message is any tree of dicts, lists, tuples, strings, numbers, numpy arrays and the dataclasses or
NamedTuples the caller registers by name (`Codec`): nothing is unpickled, a peer can only send data.

Each side's reader thread reads the frames and hands on all but heartbeats, one message at a time: it reads the
next only once its owner took the last, so a side's host holds one message (a weights bucket, a record) and a
busy side slows its peer's sends down instead of buffering them (TCP's backpressure). Heartbeats go out every
`HEARTBEAT_S` from a thread of their own; a peer that sends nothing at all for `SILENCE_S` while its bytes are
awaited (a hung or paused host: a killed process closes its socket at once) is taken for dead, as a closed
socket is: `recv` raises `ChannelClosed` naming why.

The arrays of a received frame are views of one buffer, each aligned to `ALIGN` bytes: on CPU `jax.device_put`
then keeps the bytes where they are instead of copying them (it aliases a host buffer only when it is aligned),
so a weights bucket crosses with the kernel's copies alone. Buffers are reused once nothing views them
(`_Buffers`). The buffer is not zero-filled first (a `bytearray`
would be: one more pass over every bucket), and a frame is read with `MSG_WAITALL` (one system call, not one
per socket buffer); silence is still judged by `SO_RCVTIMEO`, a receive that returns nothing for `SILENCE_S`.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import json
import socket
import struct
import sys
import threading
import time
from typing import Any

import numpy as np

HEARTBEAT_S = 5.0  # a frame at least this often, also when there is nothing to say
SILENCE_S = 30.0  # a peer silent this long is gone
MAX_FRAME_BYTES = 1 << 36  # 64 GiB: anything longer is not a frame of ours (rollout.sync_bucket_mb is far below)
ALIGN = 64  # each array of a frame starts at a multiple of this (XLA's CPU client aliases 64-byte aligned buffers)
_HEARTBEAT = "heartbeat"
_SIZE = struct.Struct(">QI")
_ZEROS = bytes(ALIGN)


class ChannelClosed(ConnectionError):
    """The peer closed the channel, died, or went silent for SILENCE_S."""


class NoPeer(ChannelClosed):
    """Nobody accepted a connection to the endpoint for as long as `connect` was told to try."""


class Codec:
    """Messages <-> (JSON header, arrays), for plain data and the registered dataclass / NamedTuple types."""

    def __init__(self, *types: type):
        self.types = {t.__name__: t for t in types}

    def encode(self, obj, arrays: list[np.ndarray]):
        if isinstance(obj, np.ndarray | np.generic) or hasattr(obj, "__array__") and not isinstance(obj, str):
            array = np.ascontiguousarray(np.asarray(obj))
            arrays.append(array)
            return {"__array__": len(arrays) - 1, "dtype": array.dtype.name, "shape": list(array.shape)}
        if obj is None or isinstance(obj, bool | int | float | str):
            return obj
        name = type(obj).__name__
        if name in self.types and type(obj) is self.types[name]:
            fields = (obj._asdict() if hasattr(obj, "_asdict")
                      else {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)})
            return {"__type__": name, "fields": {k: self.encode(v, arrays) for k, v in fields.items()}}
        if isinstance(obj, dict):
            if not all(isinstance(k, str) for k in obj):
                raise TypeError(f"a channel message's dict keys must be strings: {list(obj)[:5]}")
            return {"__dict__": {k: self.encode(v, arrays) for k, v in obj.items()}}
        if isinstance(obj, tuple) and not hasattr(obj, "_fields"):  # a NamedTuple must be registered
            return {"__tuple__": [self.encode(v, arrays) for v in obj]}
        if isinstance(obj, list):
            return [self.encode(v, arrays) for v in obj]
        raise TypeError(f"{type(obj).__qualname__} cannot go over the channel (register it with Codec)")

    def decode(self, tree, arrays: list[np.ndarray]):
        if isinstance(tree, list):
            return [self.decode(v, arrays) for v in tree]
        if not isinstance(tree, dict):
            return tree
        if "__array__" in tree:
            return arrays[tree["__array__"]]
        if "__tuple__" in tree:
            return tuple(self.decode(v, arrays) for v in tree["__tuple__"])
        if "__dict__" in tree:
            return {k: self.decode(v, arrays) for k, v in tree["__dict__"].items()}
        kind = self.types.get(tree.get("__type__"))
        if kind is None:
            raise ValueError(f"the peer sent an unknown type {tree.get('__type__')!r}")
        return kind(**{k: self.decode(v, arrays) for k, v in tree["fields"].items()})


def _dtype(name: str) -> np.dtype:
    """A dtype by name, bfloat16 and the other ml_dtypes too."""
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))


class _Buffers:
    """Receive buffers, each reused once no array views it any more (a weights bucket placed on the devices and
    copied there, or, on CPU, the params made of it released): a frame lands in memory the kernel has mapped
    already, instead of faulting in (and zeroing) a fresh page every 4 KiB. A buffer is a ctypes array: numpy
    arrays made from it, and whatever holds them (a jax CPU array aliasing one), keep a reference to it, so it is
    free when its reference count is the pool's own. Up to KEEP buffers of each size (a publish's buckets share a
    few sizes); frames under MIN_BYTES are not kept."""

    KEEP, MIN_BYTES = 64, 1 << 20

    def __init__(self):
        self._kept: dict[int, list] = {}
        self._lock = threading.Lock()

    def take(self, n: int) -> np.ndarray:
        with self._lock:
            kept = self._kept.setdefault(n, []) if n >= self.MIN_BYTES else []
            slab = next((b for b in kept if sys.getrefcount(b) <= _FREE_REFS), None)
            if slab is None:
                slab = (ctypes.c_uint8 * (n + ALIGN))()
                if len(kept) < self.KEEP:
                    kept.append(slab)
        start = -ctypes.addressof(slab) % ALIGN
        return np.frombuffer(slab, np.uint8, n, start)


_FREE_REFS = 3  # a kept buffer nobody views: the pool's list, the generator's name, getrefcount's argument
_BUFFERS = _Buffers()


def host_buffer(shape, dtype) -> np.ndarray:
    """An uninitialised host array aligned as a frame's arrays are (on CPU `jax.device_put` takes it without a
    copy), from the channel's reused buffers (`_Buffers`)."""
    dtype = np.dtype(dtype)
    return _BUFFERS.take(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize).view(dtype).reshape(shape)


class Channel:
    """One connected socket: `send(kind, body)`, `recv(timeout) -> (kind, body)`, `close()`."""

    def __init__(self, sock: socket.socket, codec: Codec, peer: str):
        self.sock, self.codec, self.peer = sock, codec, peer
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(None)  # sends block while the peer's reader waits (backpressure); see _read_exactly
        # A receive that gets nothing for SILENCE_S returns (EAGAIN): the reader's silence check (sends unaffected).
        seconds = int(SILENCE_S)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                        struct.pack("ll", seconds, int((SILENCE_S - seconds) * 1e6)))
        self._send_lock = threading.Lock()
        self._inbox: collections.deque = collections.deque()  # at most one message: the reader waits for `recv`
        self._inbox_changed = threading.Condition()
        self.closed_because: str | None = None
        self._closing = threading.Event()
        self.bytes_sent = self.bytes_received = 0
        self._reader = threading.Thread(target=self._read_loop, name="jgrpo-channel-reader", daemon=True)
        self._beater = threading.Thread(target=self._heartbeat_loop, name="jgrpo-channel-heartbeat", daemon=True)
        self._reader.start()
        self._beater.start()

    @property
    def local_ip(self) -> str:
        """This side's IP on the connection: the interface the peer reached it at."""
        return self.sock.getsockname()[0]

    # ------------------------------------------------------------------ sending

    def send(self, kind: str, body: Any = None) -> int:
        """Send one message; returns its size in bytes. Raises ChannelClosed if the peer is gone."""
        arrays: list[np.ndarray] = []
        header = json.dumps({"kind": kind, "body": self.codec.encode(body, arrays)}).encode()
        parts, offset = [header], len(header)
        for a in arrays:
            if a.nbytes:
                padding = -offset % ALIGN
                parts += [_ZEROS[:padding], memoryview(a.reshape(-1).view(np.uint8))]  # any dtype, as bytes
                offset += padding + a.nbytes
        size = 4 + offset
        parts.insert(0, _SIZE.pack(size, len(header)))
        try:
            with self._send_lock:
                for part in parts:
                    if len(part):
                        self.sock.sendall(part)
        except OSError as e:
            self._close(f"sending to {self.peer} failed: {e}")
            raise ChannelClosed(self.closed_because) from None
        self.bytes_sent += 8 + size
        return 8 + size

    def _heartbeat_loop(self) -> None:
        while not self._closing.wait(HEARTBEAT_S):
            try:
                self.send(_HEARTBEAT)
            except ChannelClosed:
                return

    # ------------------------------------------------------------------ receiving

    def recv(self, timeout: float | None = None) -> tuple[str, Any]:
        """The next message (kind, body); raises ChannelClosed once the peer is gone and every message it sent
        is read, or TimeoutError after `timeout` seconds without one."""
        with self._inbox_changed:
            if not self._inbox_changed.wait_for(lambda: self._inbox or self.is_closed, timeout):
                raise TimeoutError(f"no message from {self.peer} in {timeout:.0f} s")
            if not self._inbox:
                raise ChannelClosed(self.closed_because)
            item = self._inbox.popleft()
            self._inbox_changed.notify_all()
        return item

    def _read_exactly(self, n: int) -> np.ndarray:
        """The next `n` bytes, in a buffer aligned to ALIGN (uninitialised until read: not zero-filled)."""
        buf = _BUFFERS.take(n)
        view, got = memoryview(buf), 0
        while got < n:
            try:  # MSG_WAITALL: the rest at once, or what came before SILENCE_S without a byte (SO_RCVTIMEO)
                k = self.sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
            except (BlockingIOError, TimeoutError):
                k = -1
            if k == 0:
                raise ChannelClosed(f"{self.peer} closed the connection")
            if k < 0:
                raise ChannelClosed(f"{self.peer} sent nothing for {SILENCE_S:.0f} s (no heartbeat either)")
            got += k
        return buf

    def _read_loop(self) -> None:
        try:
            while True:
                size, header_size = _SIZE.unpack(self._read_exactly(_SIZE.size))
                if not 4 <= size <= MAX_FRAME_BYTES or header_size > size - 4:  # e.g. an HTTP probe: "GET / HT"
                    raise ValueError(f"a frame of {size} bytes")
                frame = self._read_exactly(size - 4)
                self.bytes_received += 8 + size
                message = json.loads(frame[:header_size].tobytes())
                if message["kind"] == _HEARTBEAT:
                    continue
                arrays, offset = [], header_size
                for i, spec in enumerate(_array_specs(message["body"])):
                    dtype, shape = _dtype(spec["dtype"]), [int(n) for n in spec["shape"]]
                    if spec["__array__"] != i or min(shape, default=0) < 0:
                        raise ValueError(f"array {i}: {spec}")
                    count = int(np.prod(shape, dtype=np.int64))
                    if count:
                        offset += -offset % ALIGN
                    arrays.append(np.frombuffer(frame, dtype, count, offset).reshape(shape))
                    offset += count * dtype.itemsize
                if offset != len(frame):
                    raise ValueError(f"{len(frame) - offset} bytes after the last array")
                item = (message["kind"], self.codec.decode(message["body"], arrays))
                with self._inbox_changed:
                    # Host memory stays at one message: the next is read (and the peer's send goes on) only once
                    # this one is taken. Silence is not judged meanwhile: the peer's bytes wait in the socket.
                    self._inbox.append(item)
                    self._inbox_changed.notify_all()
                    self._inbox_changed.wait_for(lambda: not self._inbox or self.is_closed)
                    if self.is_closed:
                        return
        except (ChannelClosed, OSError) as e:
            self._close(str(e) if isinstance(e, ChannelClosed) else f"reading from {self.peer} failed: {e}")
        except BaseException as e:  # noqa: BLE001 - a malformed frame (not a jgrpo peer of ours): closed, said why
            self._close(f"{self.peer} sent a malformed message ({type(e).__name__}: {e})")

    # ------------------------------------------------------------------ closing

    def _close(self, why: str) -> None:
        if self.closed_because is None:
            self.closed_because = why
            self._closing.set()
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.sock.close()
            with self._inbox_changed:
                self._inbox_changed.notify_all()

    @property
    def is_closed(self) -> bool:
        return self.closed_because is not None

    def close(self, why: str = "closed by this side", *, linger_s: float = 0.0) -> None:
        """Close now; `linger_s` > 0 (after a last message the peer must read, "stop" or "refused"): first stop
        sending and wait up to that long for the peer to close its side, so no reset overtakes the message."""
        if linger_s and not self.is_closed:
            self._closing.set()  # no more heartbeats
            try:
                with self._send_lock:
                    self.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            with self._inbox_changed:
                self._inbox.clear()  # (unread messages would keep the reader from seeing the peer's close)
                self._inbox_changed.notify_all()
                self._inbox_changed.wait_for(lambda: self.is_closed, linger_s)
        self._close(why)


def _array_specs(tree) -> list[dict]:
    """The array references of a decoded header, in the order of their index."""
    found = []

    def walk(node):
        if isinstance(node, list):
            for v in node:
                walk(v)
        elif isinstance(node, dict):
            if "__array__" in node:
                found.append(node)
                return
            for v in node.values():
                walk(v)

    walk(tree)
    return sorted(found, key=lambda spec: spec["__array__"])


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host, int(port)


def interface_toward(host: str, port: int) -> str:
    """This machine's IP on the interface its traffic to `host` leaves by (a UDP socket's `connect` picks the route
    and sends nothing): what a peer reaches this side at, where `gethostbyname(gethostname())` may be 127.0.1.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, port))
            return probe.getsockname()[0]
        except OSError:  # no route (an unresolvable name): the host's own name is the best guess left
            return socket.gethostbyname(socket.gethostname())


class Listener:
    """The trainer's side: a listening socket on `endpoint` (host:port; host 0.0.0.0 for every interface)."""

    def __init__(self, endpoint: str, codec: Codec):
        host, port = parse_endpoint(endpoint)
        self.codec = codec
        self.sock = socket.create_server((host, port), reuse_port=False)
        self.sock.settimeout(1.0)
        self.port = self.sock.getsockname()[1]

    def accept(self, timeout: float) -> Channel | None:
        """The next connection within `timeout` seconds, or None."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                sock, address = self.sock.accept()
            except TimeoutError:
                continue
            return Channel(sock, self.codec, f"{address[0]}:{address[1]}")
        return None

    def close(self) -> None:
        self.sock.close()


def connect(endpoint: str, codec: Codec, *, wait_s: float, retry_s: float = 1.0) -> Channel:
    """Connect to `endpoint`, retrying for up to `wait_s` seconds (the peer may be starting or restarting)."""
    host, port = parse_endpoint(endpoint)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=min(SILENCE_S, max(wait_s, 1.0)))
            return Channel(sock, codec, endpoint)
        except OSError as e:
            if time.monotonic() + retry_s > deadline:
                raise NoPeer(f"no trainer at {endpoint} after {wait_s:.0f} s ({e})") from None
            time.sleep(retry_s)
