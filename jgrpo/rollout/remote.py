"""Two jobs (`rollout.role: trainer|rollout`): the trainer's side of the channel to the rollout job.

The trainer job listens on `rollout.endpoint`; the rollout job (`jgrpo.rollout.rollout_job`) connects and says
hello with its config. Configs that differ in any key but `rollout.role` are refused, naming the keys. Then the
trainer sends where to start (the first batch it has not received: its index j, the prompt iterator's state
after the batch before, the batches dropped so far, the prompt width) and its newest published weights; from
then on each publish sends weights (`weight_buckets`, in buckets of `rollout.sync_bucket_mb`) and the rollout
job sends each batch it sampled and scored, with the version of the weights that sampled it, as a record. The
trainer judges staleness as with the producer thread (`async_producer.Intake`): one-job async's rules, other
transport.

Failures: a rollout job that closes its socket (killed) or goes silent (`channel.SILENCE_S`) is waited for, up to
`rollout.wait_timeout_s`; a restarted one connects and is told to start at the first batch not received (batches
received and not yet trained stay queued here). Past the wait the trainer raises `RolloutJobLost`, and the loop
saves before it stops. A trainer that dies restarts from its checkpoint; the rollout job then discards what it
sampled ahead and starts where the checkpoint's batch count says (jgrpo.rollout.rollout_job).
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time

import jax
import numpy as np

from jgrpo.config.loading import to_dict
from jgrpo.data.pipeline import PromptBatch
from jgrpo.parallel.channel import Channel, ChannelClosed, Codec, Listener, interface_toward, parse_endpoint
from jgrpo.parallel.device_transfer import DeviceTransfer
from jgrpo.parallel.host_arrays import gather_json, global_sum, to_global_rows
from jgrpo.parallel.mesh import SAMPLE_RULES
from jgrpo.parallel.weight_buckets import send_weights
from jgrpo.rewards.scorer import RewardResult
from jgrpo.rollout.async_producer import Intake, Produced
from jgrpo.rollout.records import Rollout
from jgrpo.rollout.sources import DataExhausted
from jgrpo.sampling.pool import SampleOutput

log = logging.getLogger(__name__)

CODEC = Codec(Rollout, PromptBatch, RewardResult, SampleOutput)  # what a record is made of
HELLO_TIMEOUT_S = 60.0  # a connection that says no hello in this long is not a rollout job


class RolloutJobLost(RuntimeError):
    """The rollout job was gone for longer than rollout.wait_timeout_s."""


def config_differences(ours: dict, theirs: dict) -> list[str]:
    """The dotted keys (all but rollout.role) in which two resolved configs differ."""
    ours, theirs = json.loads(json.dumps(ours)), json.loads(json.dumps(theirs))  # tuples as lists, as sent
    differ = []
    for section in sorted(set(ours) | set(theirs)):
        a, b = ours.get(section), theirs.get(section)
        if isinstance(a, dict) and isinstance(b, dict):
            differ += [f"{section}.{key}" for key in sorted(set(a) | set(b))
                       if (section, key) != ("rollout", "role") and a.get(key) != b.get(key)]
        elif a != b:
            differ.append(section)
    return differ


class RemoteRollouts(Intake):
    """The trainer's intake from a rollout job: `publish` weights, `take` batches (as `AsyncRollouts`)."""

    def __init__(self, config, *, first_index: int, dropped: int, data_state: dict, prompt_width: int, train_mesh):
        super().__init__(max_staleness=config.rollout.max_staleness, first_index=first_index, dropped=dropped)
        self.config, self.train_mesh = config, train_mesh
        self.rows = config.data.batch_size * config.grpo.num_generations
        self.endpoint = config.rollout.endpoint
        self._resolved = to_dict(config)
        # Where a (re)connecting rollout job starts: after the last batch received, trained or not.
        self._received, self._received_state, self._prompt_width = first_index, data_state, prompt_width
        self._latest = None  # (params, version): the newest published weights, sent on every (re)connection
        self._channel: Channel | None = None
        self._pending: list[Channel] = []  # connections that passed the hello, for the trainer's thread to start
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self.sync_bytes = 0  # weights sent since the last take (rollout/weight_sync_gb)
        # Process 0 listens on rollout.endpoint; with several processes each other one on a port of its own,
        # and each rollout process connects to its peer, the trainer process of its index (`peers`).
        host, _ = parse_endpoint(self.endpoint)
        loopback = host.startswith("127.") or host == "localhost"
        first = jax.process_index() == 0
        self._listener = Listener(self.endpoint if first else f"{host if loopback else '0.0.0.0'}:0", CODEC)
        here = host if loopback else interface_toward(host, parse_endpoint(self.endpoint)[1])
        self.peers = gather_json(self.endpoint if first else f"{here}:{self._listener.port}")
        # rollout.weight_transfer jax: every process offers its buckets from a transfer server of its own (decided
        # by the config, not by a live connection: the gathers before an offer are collectives of all processes).
        self._transfer = DeviceTransfer() if config.rollout.weight_transfer == "jax" else None
        self._stash: collections.deque = collections.deque()  # messages read while waiting for "weights_pulled"
        self._unstarted = False  # a connection adopted but not yet told where to start
        self._acceptor = threading.Thread(target=self._accept_loop, name="jgrpo-rollout-listener", daemon=True)
        self._acceptor.start()
        log.info("two jobs: the trainer listens for the rollout job on %s", self.peers[jax.process_index()])

    # ------------------------------------------------------------------ connections

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            channel = self._listener.accept(timeout=1.0)
            if channel is None:
                continue
            try:
                kind, body = channel.recv(timeout=HELLO_TIMEOUT_S)
                differ = config_differences(self._resolved, body["config"]) if kind == "hello" else ["(no hello)"]
                processes, process = body.get("processes", 1), body.get("process", 0)
            except (ChannelClosed, TimeoutError, KeyError, TypeError, AttributeError) as e:
                log.warning("a connection from %s said no hello (%s): closed", channel.peer, e)
                channel.close()
                continue
            if self._stopping.is_set():  # accepted in this trainer's last second: the job must find the next one
                channel.close("the trainer is stopping")
                continue
            reason = None
            if differ:
                reason = (f"the rollout job's config differs from the trainer's in {', '.join(differ)} (all keys but "
                          "rollout.role must agree: start both jobs from the same config file)")
            elif (processes, process) != (jax.process_count(), jax.process_index()):
                reason = (f"the rollout job has {processes} processes and the trainer job {jax.process_count()} "
                          f"(process {process} connected to trainer process {jax.process_index()}): give both jobs "
                          "the same number of processes, each rollout process i connecting to trainer process i")
            if reason:
                log.warning("refused the rollout job at %s: %s", channel.peer, reason)
                try:
                    channel.send("refused", {"reason": reason})
                except ChannelClosed:
                    pass
                channel.close("refused", linger_s=5.0)
                continue
            try:  # where the other rollout processes connect: their peers, the trainer process of each index
                channel.send("welcome", {"peers": self.peers})
            except ChannelClosed:
                continue
            with self._lock:
                self._pending.append(channel)

    def _connected(self) -> Channel:
        """The live channel; a newly connected rollout job is told where to start and given the newest weights
        first. Waits up to rollout.wait_timeout_s for one, else raises RolloutJobLost. With several processes they
        decide together (small collectives): all wait until every one has its peer, then all start theirs."""
        deadline = time.monotonic() + self.config.rollout.wait_timeout_s
        announced = False
        while True:
            if self._channel is not None and self._channel.is_closed:
                log.warning("two jobs: lost the rollout job (%s)", self._channel.closed_because)
                self._channel = None
            with self._lock:
                pending, self._pending = self._pending, []
            for channel in pending[:-1]:  # only the newest connection counts
                channel.close("superseded by a newer connection")
            if pending:
                if self._channel is not None:
                    self._channel.close("a restarted rollout job connected")
                self._channel, self._unstarted = pending[-1], True
                # The old job's batches stashed during a weight send are received (and trained); anything else
                # it said (an error) was about itself.
                self._stash = collections.deque(m for m in self._stash if m[0] == "record")
            live = self._channel is not None and not self._channel.is_closed
            waiting, starting, late = global_sum(np.asarray([not live, self._unstarted, time.monotonic() > deadline]))
            if not waiting:
                if starting:  # every process sends (the weights' gathers are collectives), each to its own peer
                    self._unstarted = False
                    try:
                        self._start_job(self._channel)
                    except ChannelClosed:
                        continue  # gone again: said at the loop's top, and waited for
                return self._channel
            if not announced:
                announced = True
                log.warning("two jobs: waiting up to %.0f s (rollout.wait_timeout_s) for the rollout job to connect "
                            "to %s", self.config.rollout.wait_timeout_s, self.peers[jax.process_index()])
            if late:
                raise RolloutJobLost(f"no rollout job connected to {self.endpoint} for "
                                     f"{self.config.rollout.wait_timeout_s:.0f} s (rollout.wait_timeout_s): the "
                                     "trainer saved and stopped. Start the rollout job (rollout.role: rollout, the "
                                     "same config) and run the trainer again to resume")
            time.sleep(0.2)

    def _start_job(self, channel: Channel) -> None:
        log.info("two jobs: the rollout job at %s starts at batch %d", channel.peer, self._received)
        try:
            channel.send("start", {"first_index": self._received, "data_state": self._received_state,
                                   "dropped": self.dropped, "prompt_width": self._prompt_width})
        finally:  # also after a failed send: the other processes' weight gathers need this one's
            if self._latest is not None:
                self._send_weights(channel, *self._latest)

    # ------------------------------------------------------------------ weights and batches

    def publish(self, params, version: int) -> None:
        """Newer weights for the rollout job: sent now if it is connected, else when it connects."""
        self._latest = (params, version)
        # A connection not yet started gets these weights right after its start message, not before it.
        channel = None if self._unstarted else self._channel
        if channel is None and jax.process_count() == 1:
            return  # (with several processes every one takes part in the send's gathers, connected or not)
        try:
            self._send_weights(channel, params, version)
        except ChannelClosed as e:
            if channel is not None:  # (None: not connected or started yet, nothing to say)
                log.warning("two jobs: the rollout job is gone (%s); the weights go out when it reconnects", e)

    def _send_weights(self, channel: Channel | None, params, version: int) -> None:
        def pulled(bucket: int) -> None:  # device to device: the rollout job says when it has pulled a bucket
            while True:
                try:
                    kind, body = channel.recv(timeout=self.config.rollout.wait_timeout_s)
                except TimeoutError:  # alive but not pulling: as gone (`_connected` waits for it to come back)
                    channel.close("no weights_pulled within rollout.wait_timeout_s")
                    raise ChannelClosed(f"the rollout job did not pull bucket {bucket}") from None
                if kind == "weights_pulled" and (body["version"], body["bucket"]) == (version, bucket):
                    return
                if kind == "record":  # a batch sent meanwhile: received (a restarted job starts after it), and
                    self._received, self._received_state = body["index"] + 1, body["data_state"]
                self._stash.append((kind, body))  # `_next` takes it first

        sent = send_weights(channel, params, version=version, bucket_bytes=self.config.rollout.sync_bucket_mb << 20,
                            extra={"dropped": self.dropped}, transfer=self._transfer, pulled=pulled,
                            pull_timeout_s=self.config.rollout.wait_timeout_s)
        self.sync_bytes += sent["bytes"]

    def _next(self):
        while True:
            channel = self._connected()
            wait = self.config.rollout.wait_timeout_s
            try:
                kind, body = self._stash.popleft() if self._stash else channel.recv(timeout=wait)
            except ChannelClosed:  # `_connected` says so and waits for the job to come back
                continue
            except TimeoutError:  # alive (heartbeats) but no batch: a stuck sampler is as good as gone
                raise RolloutJobLost(f"the rollout job at {channel.peer} sent no batch for {wait:.0f} s "
                                     "(rollout.wait_timeout_s): the trainer saved and stopped") from None
            if kind == "error":
                error = DataExhausted if body["type"] == "DataExhausted" else RuntimeError
                return error(f"the rollout job stopped: {body['message']}"), 0, 0.0
            if kind != "record":
                log.warning("two jobs: ignored a %r message from the rollout job", kind)
                continue
            self._received, self._received_state = body["index"] + 1, body["data_state"]
            rollout = body["rollout"]
            samples = rollout.samples.map(lambda x: to_global_rows(np.asarray(x), self.train_mesh, SAMPLE_RULES,
                                                                   self.rows))
            rollout.samples = samples
            rollout.rewards = np.asarray(rollout.rewards)
            return (Produced(rollout, body["version"], body["index"], body["data_state"]), body["queued"],
                    body["idle"])

    def take(self, iteration: int):
        produced, metrics = super().take(iteration)
        metrics["rollout/weight_sync_gb"], self.sync_bytes = self.sync_bytes / 1e9, 0
        return produced, metrics

    def close(self, run_over: bool = True) -> None:
        """Stop listening; `run_over`: tell the rollout job the run is over (it exits 0), else (preempted, or an
        error) just go, and the rollout job waits for the trainer to come back."""
        self._stopping.set()
        if self._channel is not None and not self._channel.is_closed:
            if run_over:
                try:
                    self._channel.send("stop")
                except ChannelClosed:
                    pass
            self._channel.close("the trainer is done" if run_over else "the trainer stops", linger_s=5.0 * run_over)
        self._acceptor.join()
        self._listener.close()


