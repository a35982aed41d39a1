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
    # async, when a newer version of the weights takes effect. between_batches: a batch is sampled to its end with
    # the version it started with (the slots drain at each batch's end). in_flight: one pool never drains, the next
    # batches' rows start as rows finish, and version k takes effect at a decode-chunk boundary while rows go on
    # (their keys/values kept): the first boundary at which the batches of iterations 0 .. k - 1 + in_flight_lag
    # are complete (one version per boundary), the sampler waiting there for version k if it is late, so the
    # tokens do not depend on timing; with checkpoints, a resume from one goes on bit for bit.
    # Every token records its version; a batch's staleness is its oldest token's. jgrpo/rollout/in_flight.py.
    weight_updates: Literal["between_batches", "in_flight"] = "between_batches"
    # in_flight: how many batches past those version k trains on the sampler completes before it takes version k
    # (the trainer's time to train, in batches sampled); 1 <= lag <= max_staleness - publish_every + 1. The sampler
    # holds max_staleness - lag + 1 batches at once (the most the staleness bound lets it start).
    in_flight_lag: int = 1
    # in_flight: the keys/values rows in flight computed with older weights, when a version takes effect. keep
    # (PipelineRL): as they are; a token's behaviour log-prob is then the sampler's, which no single version
    # reproduces. recompute (AReaL): every live prompt's and running row's context computed again with the new
    # weights (a forward over each running row's prompt and tokens per update), so each token is drawn in a context
    # of its own version alone.
    in_flight_kv: Literal["keep", "recompute"] = "keep"
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
        if self.weight_updates == "in_flight":
            most = self.max_staleness - self.publish_every + 1
            _check(1 <= self.in_flight_lag <= most, "rollout.in_flight_lag", self.in_flight_lag,
                   f"between 1 and rollout.max_staleness - rollout.publish_every + 1 = {most} with "
                   "rollout.weight_updates=in_flight (lag 0 would stop the sampler while the trainer trains; a "
                   "larger lag would start batches staler than the bound)")
            _check(self.mode == "async", "rollout.mode", self.mode, "async with rollout.weight_updates=in_flight")
        _check(self.max_staleness >= self.publish_every - 1, "rollout.max_staleness", self.max_staleness,
               f">= rollout.publish_every - 1 = {self.publish_every - 1}: params published every "
               f"{self.publish_every} iterations are that stale at the last iteration before the next publish")
