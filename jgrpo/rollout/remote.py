"""Two jobs (`rollout.role: trainer|rollout`): the trainer's side of the channel to the rollout job.

The trainer job listens on `rollout.endpoint`; the rollout job (`jgrpo.rollout.rollout_job`) connects and says
hello with its config. Configs that differ in any key but `rollout.role` are refused, naming the keys. Then the
trainer sends where to start (the first batch it has not received: its index j, the prompt iterator's state
after the batch before, the batches dropped so far, the prompt width) and its newest published weights; from
then on each publish sends weights (`parallel/weights/send.py`: whole, or the changes since the version the
rollout job holds, `rollout.weight_delta`, in buckets of `rollout.sync_bucket_mb`, checked by fingerprint) and
the rollout job sends each batch it sampled and scored, with the version of the weights that sampled it, as a
record. With LoRA only the adapters cross: the rollout job holds the frozen base it loaded itself. The
trainer judges staleness as with the producer thread (`intake.Intake`): one-job async's rules, other
transport.

Failures: a rollout job that closes its socket (killed) or goes silent (`channel.SILENCE_S`) is waited for, up to
`rollout.wait_timeout_s`; a restarted one connects and is told to start at the first batch not received (batches
received and not yet trained stay queued here). Past the wait the trainer raises `RolloutJobLost`, and the loop
saves before it stops. A trainer that dies restarts from its checkpoint; the rollout job then discards what it
sampled ahead and starts where the checkpoint's batch count says (jgrpo.rollout.rollout_job).

With several processes, each trainer process has a link to every rollout process whose rows it trains
(`process_links.trainer_sources`): a batch is received once every link has sent its part, joined in row order.
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
from jgrpo.parallel.host_arrays import gather_json, global_sum, to_global_rows
from jgrpo.parallel.mesh import SAMPLE_RULES
from jgrpo.parallel.weights.device_transfer import DeviceTransfer
from jgrpo.parallel.weights.send import WeightSender
from jgrpo.rewards.scorer import RewardResult
from jgrpo.rollout.intake import Intake, Produced
from jgrpo.rollout.process_links import join_rollouts, link_problem, rollout_targets, trainer_sources, weight_peers
from jgrpo.rollout.records import Rollout
from jgrpo.rollout.sources import DataExhausted
from jgrpo.sampling.state import SampleOutput

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
        # The rollout job being served: its connection attempt's id, process count, and a channel per rollout
        # process this trainer process takes rows from (`process_links.trainer_sources`).
        self._job, self._rollouts, self._links = None, 0, {}
        self._pending: list[tuple[str, int, int, Channel]] = []  # (job, processes, process, channel) welcomed
        self._parts: dict[int, dict[int, dict]] = {}  # batch index -> rollout process -> its part's record
        self._ready: collections.deque = collections.deque()  # whole records (and errors) not yet taken
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self.sync_bytes = 0  # weights sent since the last take (rollout/weight_sync_gb)
        # Process 0 listens on rollout.endpoint; with several processes each other one on a port of its own, and
        # each rollout process connects to the trainer processes whose rows it holds (`peers`).
        host, _ = parse_endpoint(self.endpoint)
        loopback = host.startswith("127.") or host == "localhost"
        first = jax.process_index() == 0
        self._listener = Listener(self.endpoint if first else f"{host if loopback else '0.0.0.0'}:0", CODEC)
        here = host if loopback else interface_toward(host, parse_endpoint(self.endpoint)[1])
        self.peers = gather_json(self.endpoint if first else f"{here}:{self._listener.port}")
        # rollout.weight_transfer jax: every process offers its buckets from a transfer server of its own (decided
        # by the config, not by a live connection: the gathers before an offer are collectives of all processes).
        transfer = DeviceTransfer() if config.rollout.weight_transfer == "jax" else None
        self._weights = WeightSender(bucket_bytes=config.rollout.sync_bucket_mb << 20,
                                     delta=config.rollout.weight_delta, transfer=transfer, answer=self._answer,
                                     pull_timeout_s=config.rollout.wait_timeout_s)
        self._publish_stats: dict = {}  # the last publish's (rollout/weight_* metrics)
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
                processes, process, job = body.get("processes", 1), body.get("process", 0), body.get("job", "")
            except (ChannelClosed, TimeoutError, KeyError, TypeError, AttributeError) as e:
                log.warning("a connection from %s said no hello (%s): closed", channel.peer, e)
                channel.close()
                continue
            if self._stopping.is_set():  # accepted in this trainer's last second: the job must find the next one
                channel.close("the trainer is stopping")
                continue
            reason = None
            trainers, here = jax.process_count(), jax.process_index()
            if differ:
                reason = (f"the rollout job's config differs from the trainer's in {', '.join(differ)} (all keys but "
                          "rollout.role must agree: start both jobs from the same config file)")
            elif (problem := link_problem(trainers, processes)) is not None:
                reason = problem
            elif here not in rollout_targets(process, trainers, processes):
                reason = (f"rollout process {process} of {processes} connected to trainer process {here} of "
                          f"{trainers}, which does not train its rows")
            if reason:
                log.warning("refused the rollout job at %s: %s", channel.peer, reason)
                try:
                    channel.send("refused", {"reason": reason})
                except ChannelClosed:
                    pass
                channel.close("refused", linger_s=5.0)
                continue
            try:  # where the rollout processes connect: the trainer processes, in order
                channel.send("welcome", {"peers": self.peers})
            except ChannelClosed:
                continue
            with self._lock:
                self._pending.append((job, processes, process, channel))

    def _adopt(self, job: str, processes: int, process: int, channel: Channel) -> None:
        """A welcomed connection joins the links: of the job being served, or of a new one (a restarted rollout
        job), which replaces the old job's links and drops the parts of batches it had not sent whole."""
        if job != self._job:
            for old in self._links.values():
                old.close("a restarted rollout job connected")
            self._job, self._rollouts, self._links = job, processes, {}
            self._weights.forget()  # it holds no weights: the next publish is whole
            self._parts.clear()  # the new job samples them again, from the first batch not received whole
            self._ready = collections.deque(m for m in self._ready if m[0] == "record")  # received: trained
        if process in self._links:
            self._links[process].close("superseded by a newer connection")
        self._links[process] = channel
        self._unstarted = True

    def _sources(self) -> list[int]:
        """The rollout processes whose rows this trainer process trains (none before a job connects)."""
        if self._job is None:
            return []
        return trainer_sources(jax.process_index(), jax.process_count(), self._rollouts)

    def _connected(self) -> dict[int, Channel]:
        """The live links; a newly connected rollout job is told where to start and given the newest weights first.
        Waits up to rollout.wait_timeout_s for one, else raises RolloutJobLost. With several processes they decide
        together (small collectives): all wait until every one has all its links, then all start them."""
        deadline = time.monotonic() + self.config.rollout.wait_timeout_s
        announced = False
        while True:
            for process, channel in list(self._links.items()):
                if channel.is_closed:
                    log.warning("two jobs: lost rollout process %d (%s)", process, channel.closed_because)
                    del self._links[process]
            with self._lock:
                pending, self._pending = self._pending, []
            for welcomed in pending:
                self._adopt(*welcomed)
            live = self._job is not None and all(j in self._links for j in self._sources())
            waiting, starting, late = global_sum(np.asarray([not live, self._unstarted, time.monotonic() > deadline]))
            if not waiting:
                if starting:  # every process sends (the weights' gathers are collectives), each to its own links
                    self._unstarted = False
                    self._start_job()
                    continue  # a link lost on the way is said at the loop's top, and waited for
                return self._links
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

    def _start_job(self) -> None:
        for process, channel in self._links.items():
            log.info("two jobs: the rollout job at %s starts at batch %d (rollout process %d)", channel.peer,
                     self._received, process)
            try:
                channel.send("start", {"first_index": self._received, "data_state": self._received_state,
                                       "dropped": self.dropped, "prompt_width": self._prompt_width})
            except ChannelClosed:
                pass
        self._weights.forget()  # a started rollout process holds nothing yet: whole
        if self._latest is not None:  # (also after a failed start: the other processes' weight gathers need ours)
            self._send_weights(*self._latest)

    # ------------------------------------------------------------------ weights and batches

    def publish(self, params, version: int) -> None:
        """Newer weights for the rollout job: sent now if it is connected, else when it connects."""
        self._latest = (params, version)
        # A connection not yet started gets these weights right after its start message, not before it.
        if (self._unstarted or not self._links) and jax.process_count() == 1:
            return  # (with several processes every one takes part in the send's gathers, connected or not)
        self._send_weights(params, version, started=not self._unstarted)

    def _send_weights(self, params, version: int, started: bool = True) -> None:
        """To the rollout processes this trainer process serves weights (`process_links.weight_peers`)."""
        peers = weight_peers(jax.process_index(), jax.process_count(), self._rollouts) if self._job is not None else []
        channels = [self._links[j] for j in peers if j in self._links] if started else []
        stats = self._weights.publish(channels, params, version, rollouts=self._rollouts if started else 0,
                                      extra={"dropped": self.dropped})
        self.sync_bytes += stats["bytes"]
        self._publish_stats = stats

    def _answer(self, channel: Channel, kind: str, version: int, bucket: int | None) -> dict:
        """The rollout process's next `kind` message about `version` (and `bucket`) on `channel`; records that arrive
        first are kept (`_read`). Silence past rollout.wait_timeout_s: as gone (`_connected` waits for it)."""
        while True:
            try:
                message = self._read(self._process_of(channel), channel, self.config.rollout.wait_timeout_s)
            except TimeoutError:
                channel.close(f"no {kind} within rollout.wait_timeout_s")
                raise ChannelClosed(f"the rollout job did not answer {kind} for version {version}") from None
            if message is not None and message[0] == kind and message[1]["version"] == version and \
                    message[1].get("bucket", bucket) == bucket:
                return message[1]

    def _process_of(self, channel: Channel) -> int:
        return next(j for j, c in self._links.items() if c is channel)

    def _read(self, process: int, channel: Channel, timeout: float):
        """One message from rollout process `process`: a record part is kept until its batch is whole (then the
        joined record joins `_ready`, and the batch counts as received: a restarted job starts after it); an error
        joins `_ready`; anything else is returned."""
        kind, body = channel.recv(timeout=timeout)
        if kind == "error":
            self._ready.append((kind, body))
        elif kind == "record":
            parts = self._parts.setdefault(body["index"], {})
            parts[process] = body
            sources = self._sources()
            if all(j in parts for j in sources):
                del self._parts[body["index"]]
                whole = dict(parts[sources[0]], rollout=join_rollouts([parts[j]["rollout"] for j in sources]))
                self._received, self._received_state = whole["index"] + 1, whole["data_state"]
                self._ready.append(("record", whole))
        else:
            return kind, body
        return None

    def _next(self):
        while True:
            if self._ready:
                kind, body = self._ready.popleft()
                if kind == "error":
                    error = DataExhausted if body["type"] == "DataExhausted" else RuntimeError
                    return error(f"the rollout job stopped: {body['message']}"), 0, 0.0
                rollout = body["rollout"]
                rollout.samples = rollout.samples.map(lambda x: to_global_rows(np.asarray(x), self.train_mesh,
                                                                               SAMPLE_RULES, self.rows))
                rollout.rewards = np.asarray(rollout.rewards)
                return (Produced(rollout, body["version"], body["index"], body["data_state"], body.get("metrics")),
                        body["queued"], body["idle"])
            links = self._connected()
            # The next part of the first batch not yet whole: from the first link that has not sent it.
            have = self._parts.get(self._received, {})
            process = next(j for j in self._sources() if j not in have)
            wait = self.config.rollout.wait_timeout_s
            try:
                message = self._read(process, links[process], wait)
            except ChannelClosed:  # `_connected` says so and waits for the job to come back
                continue
            except TimeoutError:  # alive (heartbeats) but no batch: a stuck sampler is as good as gone
                raise RolloutJobLost(f"the rollout job at {links[process].peer} sent no batch for {wait:.0f} s "
                                     "(rollout.wait_timeout_s): the trainer saved and stopped") from None
            if message is not None:
                log.warning("two jobs: ignored a %r message from the rollout job", message[0])

    def take(self, iteration: int):
        produced, metrics = super().take(iteration)
        metrics["rollout/weight_sync_gb"], self.sync_bytes = self.sync_bytes / 1e9, 0
        last = self._publish_stats
        metrics.update({"rollout/weight_sync_s": last.get("seconds", 0.0),
                        "rollout/weight_changed_fraction": last.get("changed_fraction") or 0.0,
                        "rollout/weight_as_changes": float(last.get("kind") == "changes"),
                        "rollout/weight_whole_copies": float(self._weights.whole_copies),
                        "rollout/weight_mismatches": float(self._weights.mismatches)})
        return produced, metrics

    def close(self, run_over: bool = True) -> None:
        """Stop listening; `run_over`: tell the rollout job the run is over (it exits 0), else (preempted, or an
        error) just go, and the rollout job waits for the trainer to come back."""
        self._stopping.set()
        for channel in self._links.values():
            if channel.is_closed:
                continue
            if run_over:
                try:
                    channel.send("stop")
                except ChannelClosed:
                    pass
            channel.close("the trainer is done" if run_over else "the trainer stops", linger_s=5.0 * run_over)
        self._acceptor.join()
        self._listener.close()


