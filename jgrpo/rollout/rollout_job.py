"""Two jobs (`rollout.role: rollout`): the rollout job, which samples and scores for a trainer job it connects to.

It holds no state of its own. It loads what sampling needs (tokenizer, data, rewards, the model's structure and
the sampler: `run_parts`), connects to `rollout.endpoint` and says hello with its config; the trainer sends
where to start (batch index j, the prompt iterator's state, drops so far, prompt width) and its newest weights.
Then one-job async's producer thread (`async_producer.AsyncRollouts`) samples batch j with `fold_in(sample_root,
j)` and the newest weights within the staleness bound, and a forwarding thread sends each scored batch to the
trainer as a record, while this thread receives the weights of each publish (`parallel/weights/receive.py`: whole,
or the changes since the version it holds, built beside the one that samples and handed over once the trainer
confirmed them; with LoRA only the adapters, joined to the base this job loaded itself). It writes nothing under
`run.output_dir`; its rollout metrics travel in the records.

With several processes, process 0 connects first and learns the trainer processes' addresses; each process then
talks to the trainer processes that train its rows (`process_links`: one, or several when the trainer job has
more processes, each getting its part of the record), takes weights from the first of them, and process 0
decides which weights sample each batch (`AsyncRollouts(agree=...)`), so all run the same programs.

The trainer's end ("stop") ends it with status 0. A trainer that dies (its socket closes, or it goes silent)
is reconnected to for up to `rollout.wait_timeout_s` (then it exits with status 4): the batches sampled ahead
are discarded (counted as `rollout/discarded_on_resume`: they came from weights newer than the checkpoint the
trainer restarts from), and sampling starts again where the trainer's `start` says: its checkpoint's position.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

import jax

from jgrpo.config import ConfigError
from jgrpo.config.loading import to_dict
from jgrpo.models.lora import join_adapters
from jgrpo.parallel.channel import Channel, ChannelClosed, NoPeer, connect
from jgrpo.parallel.host_arrays import broadcast_json, local_rows
from jgrpo.parallel.mesh import make_meshes, replicated
from jgrpo.parallel.weights.device_transfer import DeviceTransfer
from jgrpo.parallel.weights.receive import WeightReceiver
from jgrpo.rollout.async_producer import AGREE_POLL_S, AsyncRollouts
from jgrpo.rollout.episodes import EpisodeRunner
from jgrpo.rollout.in_flight import InFlightRollouts
from jgrpo.rollout.process_links import rollout_targets, split_rollout
from jgrpo.rollout.remote import CODEC
from jgrpo.rollout.run_parts import load_run_parts
from jgrpo.rollout.sampling_weights import SamplingWeights
from jgrpo.rollout.scoring import Scoring
from jgrpo.rollout.sources import RolloutSource, sample_root

log = logging.getLogger(__name__)

EXIT_TRAINER_GONE = 4  # the trainer stayed away past rollout.wait_timeout_s


class TrainerGone(ConnectionError):
    """No trainer at rollout.endpoint for rollout.wait_timeout_s."""


class RolloutJob:
    """`RolloutJob(config).run()`: sample for the trainer at `rollout.endpoint` until it ends (returns 0)."""

    def __init__(self, config):
        self.config = config
        mesh, _ = make_meshes(config.mesh)
        parts = load_run_parts(config, mesh, mesh)
        self.scorer = parts.scorer
        weights = SamplingWeights(config, parts.params, frozen=parts.frozen, train_mesh=mesh, sample_mesh=mesh)
        # The weights the trainer sends: the sampling copy's shapes and dtypes (LoRA: of the adapters; the frozen base
        # is this job's own, loaded above, held once), laid out for this job's sampler.
        self.sample_base = parts.frozen.sample  # (the training layout's base goes with `parts`: held once)
        self.transfer = DeviceTransfer()  # its server starts on the first weights a trainer offers device to device
        self.receiver = WeightReceiver(weights.abstract_copy(parts.params), weights.shardings, transfer=self.transfer)
        root = jax.jit(lambda: sample_root(config.run.seed), out_shardings=replicated(mesh))()
        scoring = Scoring(parts.tokenizer, parts.scorer, config.reward, config.completion_tokens)
        # (rows are multi-turn episodes with an environment: its workers run on this job's hosts)
        self.episodes = (EpisodeRunner.from_config(config, sampler=parts.sampler, tokenizer=parts.tokenizer)
                         if config.env.on else None)
        self.source = RolloutSource(config, data=parts.data, sampler=parts.sampler, scoring=scoring, root=root,
                                    episodes=self.episodes)
        del parts, weights  # the loaded weights: only their structure is needed, the values come from the trainer
        # (LoRA: the frozen base in the sampling layout stays: it never changes, so the trainer sends only adapters)
        self.discarded = 0  # batches sampled and then drawn again after a restart (rollout/discarded_on_resume)
        self._drawn = 0  # batches the last connection's producer drew (the index after its last)

    def run(self) -> int:
        """Sample until the trainer ends the run (0), or no trainer answers for rollout.wait_timeout_s (4)."""
        r = self.config.rollout
        while True:
            try:
                channels, start = self._connect()
            except TrainerGone as e:
                log.error("%s", e)
                return EXIT_TRAINER_GONE
            except (ChannelClosed, TimeoutError) as e:  # welcomed, then no start (e.g. a trainer on its way out)
                log.warning("the trainer at %s did not start this job (%s): connecting again", r.endpoint, e)
                time.sleep(1.0)
                continue
            try:
                if self._serve(channels, start):
                    return 0
            except (ChannelClosed, TimeoutError) as e:  # (a weights bucket that never came: as gone)
                log.warning("the trainer at %s is gone (%s): reconnecting for up to %.0f s (rollout.wait_timeout_s)",
                            r.endpoint, e, r.wait_timeout_s)
            finally:
                for channel in channels:
                    channel.close()

    def _connect(self) -> tuple[list[Channel], dict]:
        """(a channel to each trainer process this process sends rows to, in row order; the trainer's start
        message). Process 0 connects to rollout.endpoint and is welcomed with the trainer processes' addresses;
        then every process connects to the trainer processes that train its rows (`process_links`). Process 0's
        outcome reaches the others by a broadcast every AGREE_POLL_S (no collective waits long), so all go on,
        retry or stop together. The start comes once every trainer process has all its links. Every connection of
        one attempt carries the attempt's id: a trainer tells a restarted job's links from the old ones by it."""
        r, first = self.config.rollout, jax.process_index() == 0
        attempt: dict = {}
        if first:
            job = uuid.uuid4().hex
            threading.Thread(target=self._welcome, args=(r.endpoint, attempt, job), daemon=True).start()
        while (outcome := broadcast_json(attempt.get("outcome"))) is None:
            time.sleep(AGREE_POLL_S)
        if "gone" in outcome:
            raise TrainerGone(f"{outcome['gone']} (rollout.wait_timeout_s={r.wait_timeout_s:.0f}): the rollout job "
                              "stops; start it again once the trainer runs")
        if "refused" in outcome:
            raise ConfigError(outcome["refused"])
        if "again" in outcome:  # `run` connects again
            raise ChannelClosed(outcome["again"])
        peers, job = outcome["peers"], outcome["job"]
        channels = []
        try:
            for trainer in rollout_targets(jax.process_index(), len(peers), jax.process_count()):
                if first and trainer == 0:
                    channels.append(attempt["channel"])
                    continue
                welcome: dict = {}
                self._welcome(peers[trainer], welcome, job)
                if "peers" not in welcome["outcome"]:
                    raise ChannelClosed(f"trainer process {trainer}: {welcome['outcome']}")
                channels.append(welcome["channel"])
            starts = [channel.recv(timeout=r.wait_timeout_s) for channel in channels]
            if any(kind != "start" for kind, _ in starts):
                raise ChannelClosed(f"expected the trainer's start, got {[kind for kind, _ in starts]}")
        except BaseException:
            for channel in channels:
                channel.close()
            raise
        return channels, starts[0][1]

    def _welcome(self, endpoint: str, attempt: dict, job: str) -> None:
        """Connect to `endpoint` and say hello; attempt["outcome"] = {"peers", "job"}, or why not ("gone": no
        trainer for rollout.wait_timeout_s, "refused": another config or process count, "again": closed on the
        way)."""
        channel = None
        try:
            channel = connect(endpoint, CODEC, wait_s=self.config.rollout.wait_timeout_s)
            channel.send("hello", {"config": to_dict(self.config), "process": jax.process_index(),
                                   "processes": jax.process_count(), "job": job})
            kind, body = channel.recv(timeout=self.config.rollout.wait_timeout_s)
            if kind == "refused":
                attempt["outcome"] = {"refused": f"the trainer at {endpoint} refused this rollout job: "
                                                 f"{body['reason']}"}
            elif kind != "welcome":
                raise ChannelClosed(f"expected the trainer's welcome, got a {kind!r} message")
            else:
                attempt["channel"], attempt["outcome"] = channel, {"peers": body["peers"], "job": job}
                return
        except NoPeer as e:
            attempt["outcome"] = {"gone": str(e)}
        except (ChannelClosed, TimeoutError) as e:  # accepted, then closed (a trainer on its way out): again
            attempt["outcome"] = {"again": str(e)}
        if channel is not None:
            channel.close()

    def _serve(self, channels: list[Channel], body: dict) -> bool:
        """One connection: True when the trainer ended the run, False (or ChannelClosed) when it went away. The
        weights come from the first channel's trainer process; the rows go to each channel's, a part each."""
        if body["data_state"] is not None:
            self.source.set_data_state(body["data_state"])
        # What was sampled at or after the start (queued here, or sent to a trainer that died before training
        # it) is sampled again: it came from weights the restarted trainer no longer has.
        self.discarded += max(0, self._drawn - body["first_index"])
        log.info("sampling for the trainer from batch %d", body["first_index"])
        r = self.config.rollout
        if r.weight_updates == "in_flight":  # (the trainer published version first_index - dropped at its start)
            producer = InFlightRollouts(self.source, max_staleness=r.max_staleness, lag=r.in_flight_lag,
                                        publish_every=r.publish_every, first_index=body["first_index"],
                                        dropped=body["dropped"], first_version=body["first_index"] - body["dropped"],
                                        recompute=r.in_flight_kv == "recompute")
        else:
            producer = AsyncRollouts(self.source, max_staleness=r.max_staleness, first_index=body["first_index"],
                                     dropped=body["dropped"], prompt_width=body["prompt_width"],
                                     agree=broadcast_json if jax.process_count() > 1 else None)
        stop = threading.Event()
        forwarder = threading.Thread(target=self._forward, args=(producer, channels, stop), daemon=True,
                                     name="jgrpo-rollout-forwarder")
        forwarder.start()
        channel = channels[0]
        self.receiver.forget()  # (a trainer's first publish to a new connection is whole)
        try:
            while True:
                kind, body = channel.recv()
                if kind == "stop":
                    return True
                if kind == "weights":
                    params = self.receiver.receive(channel, body, timeout=self.config.rollout.wait_timeout_s)
                    if params is None:  # found wrong by the trainer: it sends the version again, whole
                        continue
                    producer.publish(join_adapters(params, self.sample_base), body["version"],
                                     dropped=body["extra"]["dropped"])
                    del params
                    self.receiver.refill_spares()  # for the next changes, while the trainer trains
        finally:
            stop.set()
            for link in channels:  # first: a forwarder blocked in a send to a trainer that stopped reading returns
                link.close()
            producer.close()  # after the batch being sampled, if any
            forwarder.join()
            self._drawn = producer.drawn

    def _forward(self, producer: AsyncRollouts, channels: list[Channel], stop: threading.Event) -> None:
        """Send each sampled batch to the trainer, in order, until `stop` or a channel closes: the rows of each
        trainer process that trains some of this process's rows to it."""
        while not stop.is_set():
            got = producer.next_sampled(timeout=0.5)
            if got is None:
                continue
            item, queued, idle = got
            try:
                if isinstance(item, BaseException):
                    for channel in channels:
                        channel.send("error", {"type": type(item).__name__, "message": str(item)})
                    return
                rollout = item.rollout
                rollout.samples = rollout.samples.map(local_rows)
                rollout.metrics = {**rollout.metrics, "rollout/discarded_on_resume": float(self.discarded)}
                for channel, part in zip(channels, split_rollout(rollout, len(channels)), strict=True):
                    channel.send("record", {"index": item.index, "version": item.version,
                                            "data_state": item.data_state, "queued": queued, "idle": idle,
                                            "metrics": item.metrics, "rollout": part})
            except ChannelClosed:  # this batch never reached the trainer: the next start says where to go on
                return
            except Exception as e:  # noqa: BLE001 - the trainer must hear of it, not wait for a batch forever
                log.exception("could not send a batch to the trainer")
                for channel in channels:
                    try:
                        channel.send("error", {"type": type(e).__name__, "message": f"sending a batch failed: {e}"})
                    except ChannelClosed:
                        pass
                return

    def close(self) -> None:
        self.scorer.close()
        if self.episodes is not None:
            self.episodes.close()

