"""`rollout.weight_transfer: jax`: weight buckets pulled device to device between two jobs.

`jax.experimental.transfer` (jax 0.10) runs a transfer server per process: the sender registers arrays under an
id (`await_pull`), the receiver, connected to the sender's server, pulls them onto its own devices (`pull`),
over TCP between the two hosts (DCN between two slices), without the sender's host serialising them. What it
needs, found on CPU and in its source (docs/tpu.md "Two jobs"):

- an address and a transport address on the interface the peer reaches (with the defaults a pull aborts the
  process on CPU): here the IP of the channel's own socket, port 0;
- the same per-process shard list on both sides: the receiver's `ShapeDtypeStruct` sharding must split the
  array into the sender's local shards, in order, of the same byte sizes. Nothing else is checked (another
  layout of the same sizes arrives as wrong data, silently), and it does not reshard. So each bucket piece
  travels whole, on one device each side (the sender's first local device, the receiver's), and the receiver
  lays it out in its own sharding on its devices afterwards;
- the sender keeps a registered array until it is pulled (or its offer lapses), pulling an id twice hangs, and a
  pull returns before its bytes arrive: one id per bucket, the receiver waits for the arrival, then says
  "weights_pulled" on the channel, and only then does the sender offer the next bucket, so a device holds one
  bucket of it at a time.
"""

from __future__ import annotations

import datetime
import itertools

import jax


class DeviceTransfer:
    """This process's transfer server and its connections. The server starts on the first `start(host)`, `host`
    this side's IP on the channel (`Channel.local_ip`: what the peer reaches; `gethostbyname(gethostname())` may
    be a loopback address); both sides start it in `weight_buckets` when weights first go device to device."""

    def __init__(self):
        self.device = jax.local_devices()[0]
        self.server = None
        self.address: str | None = None
        self._ids = itertools.count(1)
        self._connections: dict = {}

    def start(self, host: str) -> None:
        if self.server is None:
            from jax.experimental import transfer

            self.server = transfer.start_transfer_server(self.device.client, f"{host}:0", [f"{host}:0"])
            self.address = self.server.address()

    def offer(self, arrays: list[jax.Array], timeout_s: float) -> int:
        """Register `arrays` (each on one device of this process) for one pull within `timeout_s` (an offer never
        pulled would hold its arrays on the device); returns their id."""
        uuid = next(self._ids)
        self.server.await_pull(uuid, arrays, timeout=_deadline(timeout_s))
        return uuid

    def pull(self, address: str, uuid: int, specs: list[tuple[tuple[int, ...], str]],
             timeout_s: float | None = None) -> list[jax.Array]:
        """The arrays offered under `uuid` by the server at `address`, each whole on this process's first device,
        arrived (the pull is asynchronous: waited for here, so that a failure is this call's)."""
        connection = self._connections.get(address)
        if connection is None:
            connection = self._connections[address] = self.server.connect(address)
        one = jax.sharding.SingleDeviceSharding(self.device)
        wanted = [jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=one) for shape, dtype in specs]
        try:
            if timeout_s is None:
                return jax.block_until_ready(connection.pull(uuid, wanted))
            return jax.block_until_ready(connection.pull(uuid, wanted, timeout=_deadline(timeout_s)))
        except BaseException:
            self._connections.pop(address, None)  # a broken connection is not used again
            raise


def _deadline(seconds: float) -> datetime.datetime:
    return datetime.datetime.now() + datetime.timedelta(seconds=seconds)

