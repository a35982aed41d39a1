"""The two processes of benchmarks/weight_sync.py: a sender (the trainer's side) and a receiver (the rollout job's),
2 emulated CPU devices each, joined over loopback by a control channel (jgrpo's), a plain TCP socket, and Arrow
Flight. For each size, the sender drives every path in turn, repeat after repeat (the machine's load drifts: the
paths side by side), and times each from its start to the receiver's word that it holds the bytes:

- raw: one `sendall` of a prebuilt host buffer of the params' bytes into the receiver's preallocated buffer
  (`recv_into` with MSG_WAITALL): the loopback's limit for these bytes, host to host.
- flight: the same buckets as ours (host views of the pieces, no copy) served by the sender's `pyarrow.flight`
  server, one `do_get` per bucket by the receiver (Marin's transport): host to host.
- ours: `WeightSender.publish` of the whole version -> `WeightReceiver.receive`, device to device, checked
  (the fingerprint round trip included); ours_jax: the same with `rollout.weight_transfer: jax`.
- changes_<name>: a publish of the changes from the version the receiver holds to one where the fraction <name>
  of the elements changed by one unit in the last place (a rounding boundary crossed), at random positions.
- xor_zstd_<name>: the alternative encoding of the same changes (slime's): the XOR of the new and old bits, zstd
  (level 1, pyarrow's) per bucket, and on the receiver decompressed and XORed with the version it holds, then laid
  out on its devices as a whole copy is; on the host in numpy, as ours finds and applies its changes on CPU.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from jgrpo.parallel.channel import Codec, Listener, connect, host_buffer
from jgrpo.parallel.weights.buckets import LeafAssembly, bucket_plan, read_piece
from jgrpo.parallel.weights.device_transfer import DeviceTransfer
from jgrpo.parallel.weights.receive import WeightReceiver
from jgrpo.parallel.weights.send import WeightSender


def params_of(size_mb: int, bucket_mb: int):
    """bf16 leaves of 32 MiB filling `size_mb`, one of them 1.5 buckets where that fits in half of it (a leaf
    split over two buckets in every run), rows sharded over the 2 devices (as a sampler's FSDP-free layout's)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))  # automatic axes, as jgrpo's meshes
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    split_mb = bucket_mb * 3 // 2 if bucket_mb * 3 <= size_mb else 0
    shapes = [((32 << 20) // 2 // 4096, 4096)] * ((size_mb - split_mb) // 32)
    shapes += [((split_mb << 20) // 2 // 4096, 4096)] if split_mb else []
    make = jax.jit(lambda i, shape: jax.random.normal(jax.random.key(i), shape, jnp.bfloat16) * 0.02,
                   static_argnums=1, out_shardings=sharding)
    return {f"w{i:03d}": make(i, shape) for i, shape in enumerate(shapes)}, sharding


@jax.jit
def _one_ulp_changes(params, key, fraction):
    """`params` with the given fraction of elements moved by one unit in the last place, at random positions."""
    keys = jax.random.split(key, len(params))

    def move(x, k):
        bits = jax.lax.bitcast_convert_type(x, jnp.uint16)
        return jax.lax.bitcast_convert_type(jnp.where(jax.random.uniform(k, x.shape) < fraction, bits ^ 1, bits),
                                            x.dtype)

    return {name: move(x, k) for (name, x), k in zip(sorted(params.items()), keys, strict=True)}


ZSTD = pa.Codec("zstd", compression_level=1)


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        got += sock.recv_into(view[got:], len(view) - got, socket.MSG_WAITALL)


class _FlightServer(flight.FlightServerBase):
    """Serves the current buckets' host bytes, one table (a chunk per piece) per `do_get`."""

    tables: dict = {}

    def do_get(self, context, ticket):
        return flight.RecordBatchStream(self.tables[int(ticket.ticket)])


def _as_flight_table(arrays: list[np.ndarray]) -> pa.Table:
    chunks = [pa.Array.from_buffers(pa.uint8(), a.nbytes, [None, pa.py_buffer(a.reshape(-1).view(np.uint8))])
              for a in arrays]  # one column, a chunk (a record batch on the wire) per piece, no copy
    return pa.Table.from_arrays([pa.chunked_array(chunks)], names=["bytes"])


def sender(args, ports: dict) -> list[dict]:
    control = connect(f"127.0.0.1:{ports['control']}", Codec(), wait_s=120)
    raw = socket.create_connection(("127.0.0.1", ports["raw"]))
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    server = _FlightServer("grpc://127.0.0.1:0")
    control.send("flight", {"port": server.port})

    def answer(channel, kind, version, bucket):
        got, body = channel.recv(timeout=600)
        assert got == kind and body["version"] == version, (got, kind, body)
        return body

    results, bucket_bytes = [], args.bucket_mb << 20
    state = {"version": 0, "timings": {}}

    def publish(tree, path="host", whole=False, timed=None):
        """One publish; `timed`: the key its seconds go under (the receiver's spares refilled after, untimed)."""
        state["version"] += 1
        sender_ = state["senders"][path]
        if whole:
            sender_.forget()
        control.send("publish", {"path": path})
        start = time.perf_counter()
        stats = sender_.publish([control], tree, state["version"], rollouts=1)
        if timed:
            state["timings"][timed] = time.perf_counter() - start
        control.recv(timeout=600)  # "ready": the receiver refilled its spares
        return stats

    for size in args.sizes_mb:
        params, _ = params_of(size, args.bucket_mb)
        total = sum(x.nbytes for x in jax.tree.leaves(params))
        fractions = dict(args.fractions)  # (each changed version made when used: each is as large as the params)
        control.send("size", {"size": size, "bytes": total})
        state["senders"] = {"host": WeightSender(bucket_bytes=bucket_bytes, delta="always", answer=answer),
                            "jax": WeightSender(bucket_bytes=bucket_bytes, transfer=DeviceTransfer(), answer=answer)}

        for path in ("host", "host", "host", "jax", "jax"):  # warm: compiled, the receiver's buffers reused
            publish(params, path, whole=True)
        publish(params, whole=True)  # the receiver holds the base
        for name in fractions:
            publish(_one_ulp_changes(params, jax.random.key(7), fractions[name]))
            publish(params)
        for repeat in range(args.repeats):
            timings = state["timings"] = {}
            host = np.ones(total, np.uint8)  # raw: a prebuilt buffer of the same bytes (made for it: memory is short)
            control.send("raw", {"bytes": total})
            control.recv(timeout=600)  # the receiver's buffer is ready
            start = time.perf_counter()
            raw.sendall(memoryview(host))
            raw.recv(1)
            timings["raw"] = time.perf_counter() - start
            del host
            timings["flight"] = _flight(control, server, params, bucket_bytes)
            publish(params, "host", whole=True, timed="ours")
            publish(params, "jax", whole=True, timed="ours_jax")
            for name in fractions:
                version_ = _one_ulp_changes(params, jax.random.key(7), fractions[name])
                publish(params, whole=True)  # the base, held by the receiver (untimed)
                start = time.perf_counter()  # (the receiver XORs onto the base and keeps holding the base)
                timings[f"xor_zstd_{name}_bytes"] = _xor_zstd(control, version_, params, bucket_bytes)
                timings[f"xor_zstd_{name}"] = time.perf_counter() - start
                publish(version_)  # the first changes after a whole copy: fingerprints in full (untimed)
                del version_
                stats = publish(params, timed=f"changes_{name}")  # the steady state: changes after changes
                timings[f"changes_{name}_bytes"] = stats["bytes"]
                timings[f"changes_{name}_fraction"] = stats["changed_fraction"]
            results.append({"size_mb": size, "bytes": total, "repeat": repeat, **timings})
            print(json.dumps(results[-1]), flush=True)
        del params
    control.send("stop")
    control.close()
    server.shutdown()
    return results


def _host_buckets(params, bucket_bytes: int) -> list[list[np.ndarray]]:
    leaves = jax.tree.leaves(params)
    return [[np.asarray(array) for p in bucket for _, array in read_piece(leaves[p.leaf], p, alias=True)]
            for bucket in bucket_plan(leaves, bucket_bytes)]


def _flight(control, server, params, bucket_bytes: int) -> float:
    buckets = _host_buckets(params, bucket_bytes)  # the bytes on the host already: host to host, as raw
    server.tables = {i: _as_flight_table(arrays) for i, arrays in enumerate(buckets)}
    start = time.perf_counter()
    control.send("flight_get", {"buckets": len(buckets)})
    control.recv(timeout=600)
    seconds = time.perf_counter() - start
    server.tables = {}
    return seconds


def _xor_zstd(control, new, held, bucket_bytes: int) -> int:
    """Send `new` as zstd-compressed XOR buckets against `held` (which the receiver holds); the bytes sent. On the
    host, in numpy (as ours finds its changes on CPU): the XOR of the two versions' host views, no device pass."""
    sent = 0
    for new_parts, held_parts in zip(_host_buckets(new, bucket_bytes), _host_buckets(held, bucket_bytes), strict=True):
        packed = [np.frombuffer(ZSTD.compress(np.bitwise_xor(a.view(np.uint16), b.view(np.uint16)).view(np.uint8),
                                              asbytes=True), np.uint8) for a, b in zip(new_parts, held_parts,
                                                                                       strict=True)]
        sent += control.send("xor_bucket", {"packed": packed, "sizes": [a.nbytes for a in new_parts]})
    control.send("xor_done")
    control.recv(timeout=600)
    return sent


def receiver(args, ports: dict) -> None:
    listener = Listener(f"127.0.0.1:{ports['control']}", Codec())
    raw_listener = socket.create_server(("127.0.0.1", ports["raw"]))
    control = listener.accept(120)
    raw, _ = raw_listener.accept()
    _, body = control.recv(timeout=120)
    client = flight.connect(f"grpc://127.0.0.1:{body['port']}")
    transfer = DeviceTransfer()
    receiver_ = None
    while True:
        kind, body = control.recv(timeout=600)
        if kind == "stop":
            return
        if kind == "size":
            params, sharding = params_of(body["size"], args.bucket_mb)
            shardings = jax.tree.map(lambda _, s=sharding: s, params)
            receiver_ = WeightReceiver(params, shardings, transfer=transfer)
            del params
        elif kind == "raw":
            buffer = np.ones(body["bytes"], np.uint8)  # preallocated, and touched, before the clock starts
            control.send("ready")
            _recv_exactly(raw, memoryview(buffer))
            raw.send(b"k")
            del buffer
        elif kind == "flight_get":
            tables = [client.do_get(flight.Ticket(str(i).encode())).read_all() for i in range(body["buckets"])]
            control.send("flight_got", {"bytes": sum(t.nbytes for t in tables)})
            del tables
        elif kind == "publish":
            while True:  # (a version found wrong is sent again whole)
                _, header = control.recv(timeout=600)
                if jax.block_until_ready(receiver_.receive(control, header, timeout=600)) is not None:
                    break
            receiver_.refill_spares()
            control.send("ready")
        elif kind == "xor_bucket":
            _receive_xor(control, receiver_, body, args.bucket_mb << 20)


def _receive_xor(control, receiver_, first: dict, bucket_bytes: int) -> None:
    """The XOR buckets, decompressed and XORed with the version held (its host views, in numpy) into new host
    buffers, laid out on the devices as ours lays out a whole copy (`LeafAssembly`)."""
    held = receiver_.held.params
    leaves = jax.tree.leaves(held)
    pieces = LeafAssembly(leaves, [x.sharding for x in leaves])
    plan = [piece for bucket in bucket_plan(leaves, bucket_bytes) for p in bucket
            for piece, _ in read_piece(leaves[p.leaf], p, alias=True)]
    held_parts = iter(_host_buckets(held, bucket_bytes))
    at, body = 0, first
    while True:
        for packed, size, old in zip(body["packed"], body["sizes"], next(held_parts), strict=True):
            xor = np.frombuffer(ZSTD.decompress(packed, decompressed_size=size, asbytes=True), np.uint16)
            out = host_buffer(old.shape, old.dtype)
            np.bitwise_xor(old.view(np.uint16).reshape(-1), xor, out=out.view(np.uint16).reshape(-1))
            pieces.add(plan[at], out)
            at += 1
        kind, body = control.recv(timeout=600)
        if kind == "xor_done":
            break
    jax.block_until_ready(list(pieces.done.values()))
    control.send("xor_applied")


def serve(role: str, args, ports: dict) -> None:
    if role == "sender":
        print(json.dumps(sender(args, ports)))
    else:
        thread = threading.Thread(target=receiver, args=(args, ports))
        thread.start()
        thread.join()
