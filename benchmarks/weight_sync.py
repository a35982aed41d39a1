"""Weight sync between two jobs (`rollout.weight_transfer` host, jax): seconds per GB, host memory against the bucket.

A sender process and a receiver process (2 emulated CPU devices each, as the two jobs of tests/rollout/
test_two_jobs.py) joined over loopback by `jgrpo.parallel.channel`; the sender sends bf16 params of each size
(32 MiB leaves, one of them 1.5 buckets where it fits: a split tensor in every run) with `send_weights`, the receiver
lays them out on its devices with `receive_weights`: `host` sends the pieces inside the channel's frames, `jax`
offers each bucket device to device (`jgrpo/parallel/device_transfer.py`) and the frames carry only what to
pull. Each path, size and bucket is sent 3 times and the fastest is kept. Host memory: the Python-heap peak
(`tracemalloc`: the frames and the host copies of the pieces) of each side during the transfers, against
`sync_bucket_mb`; the device buffers (on CPU, host memory too: the params themselves, and with jax a bucket
gathered on one device) are not counted.

    python benchmarks/weight_sync.py             # host and jax x 64 MiB, 256 MiB, 1 GiB x buckets 16, 64, 256
    python benchmarks/weight_sync.py --paths jax --sizes-mb 128 --buckets-mb 8 32

Prints a table, then one JSON line with every figure. On loopback the figure is the serialisation and the
copies, not a network: over DCN the link (v5p: 50 Gbps per chip's host share) adds its own time.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))  # this checkout's jgrpo, installed or not (children too)

ROOT = Path(__file__).resolve().parent.parent
REPEATS = 3


def params_of(size_mb: int, bucket_mb: int):
    """bf16 leaves of 32 MiB filling `size_mb`, one of them 1.5 buckets where that fits in half of it (a leaf
    split over two buckets in every run)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))  # automatic axes, as jgrpo's meshes
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    split_mb = bucket_mb * 3 // 2 if bucket_mb * 3 <= size_mb else 0  # (a 32 MiB leaf is split by smaller buckets)
    shapes = [((32 << 20) // 2 // 4096, 4096)] * ((size_mb - split_mb) // 32)
    shapes += [((split_mb << 20) // 2 // 4096, 4096)] if split_mb else []
    make = jax.jit(lambda i, shape: jnp.full(shape, i, jnp.bfloat16) + jnp.arange(shape[1], dtype=jnp.bfloat16),
                   static_argnums=1, out_shardings=sharding)
    return {f"w{i}": make(i, shape) for i, shape in enumerate(shapes)}, sharding


def child(args) -> None:
    import jax

    from jgrpo.parallel.channel import Codec, Listener, connect
    from jgrpo.parallel.weights.buckets import receive_weights, send_weights
    from jgrpo.parallel.weights.device_transfer import DeviceTransfer

    results = []
    if args.child == "receiver":
        listener = Listener(f"127.0.0.1:{args.port}", Codec())
        channel = listener.accept(120)
    else:
        channel = connect(f"127.0.0.1:{args.port}", Codec(), wait_s=120)
    transfer = DeviceTransfer() if "jax" in args.paths else None

    def pulled(channel, bucket: int) -> None:  # the sender waits for the receiver's word after each bucket (jax)
        kind, body = channel.recv()
        assert kind == "weights_pulled" and body["bucket"] == bucket, (kind, body)

    for size in args.sizes_mb:  # the paths side by side for each size and bucket (the machine's load drifts)
        for bucket in args.buckets_mb:
            params, sharding = params_of(size, bucket)
            for path in args.paths:
                best, peak = float("inf"), 0
                for _ in range(REPEATS):
                    tracemalloc.start()
                    start = time.perf_counter()
                    if args.child == "sender":
                        send_weights([channel], params, version=0, bucket_bytes=bucket << 20,
                                     transfer=transfer if path == "jax" else None, pulled=pulled)
                        channel.recv()  # the receiver's "done": the weights are on its devices
                    else:
                        _, header = channel.recv()
                        got = receive_weights(channel, header, params, jax.tree.map(lambda _, s=sharding: s, params),
                                              transfer=transfer)
                        jax.block_until_ready(got)
                        del got
                        channel.send("done")
                    seconds = time.perf_counter() - start
                    peak = max(peak, tracemalloc.get_traced_memory()[1])
                    tracemalloc.stop()
                    best = min(best, seconds)
                total = sum(x.nbytes for x in jax.tree.leaves(params))
                results.append({"path": path, "size_mb": size, "bucket_mb": bucket, "bytes": total, "seconds": best,
                                "s_per_gb": best / (total / 1e9), "host_peak_mb": peak / 2**20})
            del params
    channel.close()
    print(json.dumps(results))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--paths", nargs="+", choices=["host", "jax"], default=["host", "jax"])
    p.add_argument("--sizes-mb", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--buckets-mb", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--child", choices=["sender", "receiver"], help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2"}
    common = ["--port", str(port), "--sizes-mb", *map(str, args.sizes_mb), "--buckets-mb", *map(str, args.buckets_mb),
              "--paths", *args.paths]
    procs = {role: subprocess.Popen([sys.executable, __file__, "--child", role, *common], env=env, cwd=ROOT,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for role in ("receiver", "sender")}
    done = {role: proc.communicate() for role, proc in procs.items()}
    failed = [f"the {role} failed:\n{done[role][1][-3000:]}" for role, proc in procs.items() if proc.returncode]
    if failed:
        sys.exit("\n".join(failed))
    out = {role: json.loads(stdout.strip().splitlines()[-1]) for role, (stdout, _) in done.items()}
    print("| path | params | bucket | s / GB | sender host peak | receiver host peak |")
    print("|---|---:|---:|---:|---:|---:|")
    for sent, received in zip(out["sender"], out["receiver"], strict=True):
        print(f"| {sent['path']} | {sent['bytes'] / 2**20:.0f} MiB | {sent['bucket_mb']} MiB "
              f"| {received['s_per_gb']:.2f} "
              f"| {sent['host_peak_mb']:.0f} MiB | {received['host_peak_mb']:.0f} MiB |")
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
