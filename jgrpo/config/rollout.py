"""The `rollout` section: where each iteration's samples come from (one job or two). Importable from
jgrpo.config.sections and jgrpo.config as well."""

from __future__ import annotations

import dataclasses
from typing import Literal

from jgrpo.config.errors import check as _check


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """Where each iteration's samples come from (jgrpo/rollout/sources.py)."""

    # sync: sample each iteration's batch when the trainer reaches it. window: at each behaviour refresh, sample
    # the batches of the v iterations that behaviour serves together in one slot pool (sampler.slots; default
    # one iteration's rows); sync's tokens up to float rounding, needs a fixed grpo.behaviour_refresh and no
    # dynamic sampling.
    # async: a producer thread keeps sampling with the newest published params while the trainer trains; each
    # batch carries the version (iteration) of the params that sampled it, and its staleness when trained is at
    # most max_staleness (grpo.behaviour_refresh does not apply: leave it at 1). jgrpo/rollout/async_producer.py.
    mode: Literal["sync", "window", "async"] = "sync"
    # async: the trainer publishes its params to the producer after every this many iterations.
    publish_every: int = 1
    # async: the most iterations a batch's sampling params may lag the params it trains (0 = on-policy: the
    # producer waits for every publish, which is exactly sync at v = 1). Older batches are dropped, counted.
    max_staleness: int = 1
    # both: one job samples and trains (the modes above). trainer / rollout: two jobs, each its own jax.distributed
    # world, joined by a TCP channel (rollout.mode: async): the trainer job listens on rollout.endpoint, the
    # rollout job connects, samples with the weights the trainer sends and sends the scored batches back.
    # docs/tpu.md "Two jobs"; jgrpo/rollout/remote.py.
    role: Literal["both", "trainer", "rollout"] = "both"
    # trainer / rollout: host:port where the trainer's process 0 listens (both jobs give the same value).
    endpoint: str = ""
    # How weights reach the rollout job: host = serialized buckets over the channel; jax = each bucket pulled device
    # to device (jax.experimental.transfer), the channel carrying only its id. auto: host on every platform
    # (measured on CPU loopback, benchmarks/weight_sync.py; on TPU not yet measured).
    weight_transfer: Literal["auto", "host", "jax"] = "auto"
    # Two jobs: after the first whole copy, send only the weights whose value changed since the version the rollout
    # job holds (indices and values; a fingerprint checks every publish and a mismatch is healed by a whole copy,
    # counted as rollout/weight_mismatches). always / never (not on / off: YAML reads those as booleans). auto:
    # whichever the run measures faster, timing both as it goes (on CPU loopback whole copies win: docs/benchmarks.md
    # "Two jobs").
    weight_delta: Literal["auto", "always", "never"] = "auto"
    # The host memory one bucket of weights takes on either side (a larger tensor is split over buckets): the
    # sender holds two (one read off the devices while the other is sent), the receiver two (one read, one placed).
    sync_bucket_mb: int = 512
    # How long either job waits for the other (a restart, a preemption) before it gives up, naming the endpoint.
    wait_timeout_s: float = 1800.0

    def __post_init__(self):
        _check(self.publish_every >= 1, "rollout.publish_every", self.publish_every, "a positive integer")
        _check(self.sync_bucket_mb >= 1, "rollout.sync_bucket_mb", self.sync_bucket_mb, "a positive integer (MiB)")
        _check(self.wait_timeout_s > 0, "rollout.wait_timeout_s", self.wait_timeout_s, "> 0 seconds")
        if self.role != "both":
            host, _, port = self.endpoint.rpartition(":")
            _check(bool(host) and port.isdigit(), "rollout.endpoint", self.endpoint,
                   f"host:port with rollout.role={self.role} (where the trainer job's process 0 listens, e.g. "
                   "10.0.0.2:8477)")
            _check(self.mode == "async", "rollout.mode", self.mode,
                   f"async with rollout.role={self.role}: the rollout job samples while the trainer trains "
                   "(rollout.max_staleness: 0 is on-policy)")
        _check(self.max_staleness >= 0, "rollout.max_staleness", self.max_staleness, ">= 0")
        _check(self.max_staleness >= self.publish_every - 1, "rollout.max_staleness", self.max_staleness,
               f">= rollout.publish_every - 1 = {self.publish_every - 1}: params published every "
               f"{self.publish_every} iterations are that stale at the last iteration before the next publish")
