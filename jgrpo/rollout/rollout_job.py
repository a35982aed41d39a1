"""Two jobs (`rollout.role: rollout`): the rollout job, which samples and scores for a trainer job it connects to.

It holds no state of its own. It loads what sampling needs (tokenizer, data, rewards, the model's structure and
the sampler: `run_parts`), connects to `rollout.endpoint` and says hello with its config; the trainer sends
where to start (batch index j, the prompt iterator's state, drops so far, prompt width) and its newest weights.
Then one-job async's producer thread (`async_producer.AsyncRollouts`) samples batch j with `fold_in(sample_root,
j)` and the newest weights within the staleness bound, and a forwarding thread sends each scored batch to the
trainer as a record, while this thread receives the weights of each publish. It writes nothing under
`run.output_dir`; its rollout metrics travel in the records.

The trainer's end ("stop") ends it with status 0. A trainer that dies (its socket closes, or it goes silent)
is reconnected to for up to `rollout.wait_timeout_s`: the batches sampled ahead are discarded (counted as
`rollout/discarded_on_resume`: they came from weights newer than the checkpoint the trainer restarts from),
and sampling starts again where the trainer's `start` says, which is its checkpoint's position.
"""

from __future__ import annotations

import logging
import threading

import jax

from jgrpo.config import ConfigError
from jgrpo.config.loading import to_dict
from jgrpo.parallel.channel import ChannelClosed, connect
from jgrpo.parallel.host_arrays import local_rows
from jgrpo.parallel.mesh import make_meshes, replicated
from jgrpo.parallel.weight_buckets import receive_weights
from jgrpo.rollout.async_producer import AsyncRollouts
from jgrpo.rollout.collect import Scoring
from jgrpo.rollout.remote import CODEC
from jgrpo.rollout.run_parts import load_run_parts
from jgrpo.rollout.sampling_weights import SamplingWeights
from jgrpo.rollout.sources import RolloutSource, sample_root

log = logging.getLogger(__name__)


class RolloutJob:
    """`RolloutJob(config).run()`: sample for the trainer at `rollout.endpoint` until it ends (returns 0)."""

    def __init__(self, config):
        self.config = config
        mesh, _ = make_meshes(config.mesh)
        parts = load_run_parts(config, mesh, mesh)
        self.scorer = parts.scorer
        weights = SamplingWeights(config, parts.params, frozen=parts.frozen, train_mesh=mesh, sample_mesh=mesh)
        # The weights the trainer sends: the sampling copy's shapes and dtypes, laid out for this job's sampler.
        self.like, self.shardings = weights.abstract_copy(parts.params), weights.shardings
        root = jax.jit(lambda: sample_root(config.run.seed), out_shardings=replicated(mesh))()
        scoring = Scoring(parts.tokenizer, parts.scorer, config.reward, config.completion_tokens)
        self.source = RolloutSource(config, data=parts.data, sampler=parts.sampler, scoring=scoring, root=root)
        del parts, weights  # the loaded weights: only their structure is needed, the values come from the trainer
        self.discarded = 0  # batches sampled and then drawn again after a restart (rollout/discarded_on_resume)
        self._drawn = 0  # batches the last connection's producer drew (the index after its last)

    def run(self) -> int:
        r = self.config.rollout
        while True:
            channel = connect(r.endpoint, CODEC, wait_s=r.wait_timeout_s)
            try:
                if self._serve(channel):
                    return 0
            except ChannelClosed as e:
                log.warning("the trainer at %s is gone (%s): reconnecting for up to %.0f s (rollout.wait_timeout_s)",
                            r.endpoint, e, r.wait_timeout_s)
            finally:
                channel.close()

    def _serve(self, channel) -> bool:
        """One connection: True when the trainer ended the run, False (or ChannelClosed) when it went away."""
        channel.send("hello", {"config": to_dict(self.config)})
        kind, body = channel.recv(timeout=self.config.rollout.wait_timeout_s)
        if kind == "refused":
            raise ConfigError(f"the trainer at {self.config.rollout.endpoint} refused this rollout job: "
                              f"{body['reason']}")
        if kind != "start":
            raise ChannelClosed(f"expected the trainer's start, got a {kind!r} message")
        if body["data_state"] is not None:
            self.source.set_data_state(body["data_state"])
        # What was sampled at or after the start (queued here, or sent to a trainer that died before training
        # it) is sampled again: it came from weights the restarted trainer no longer has.
        self.discarded += max(0, self._drawn - body["first_index"])
        log.info("sampling for the trainer from batch %d", body["first_index"])
        producer = AsyncRollouts(self.source, max_staleness=self.config.rollout.max_staleness,
                                 first_index=body["first_index"], dropped=body["dropped"],
                                 prompt_width=body["prompt_width"])
        stop = threading.Event()
        forwarder = threading.Thread(target=self._forward, args=(producer, channel, stop), daemon=True,
                                     name="jgrpo-rollout-forwarder")
        forwarder.start()
        try:
            while True:
                kind, body = channel.recv()
                if kind == "stop":
                    return True
                if kind == "weights":
                    params = receive_weights(channel, body, self.like, self.shardings)
                    producer.publish(params, body["version"], dropped=body["extra"]["dropped"])
                    del params
        finally:
            stop.set()
            producer.close()  # after the batch being sampled, if any
            forwarder.join()
            self._drawn = producer.drawn

    def _forward(self, producer: AsyncRollouts, channel, stop: threading.Event) -> None:
        """Send each sampled batch to the trainer, in order, until `stop` or the channel closes."""
        while not stop.is_set():
            got = producer.next_sampled(timeout=0.5)
            if got is None:
                continue
            item, queued, idle = got
            try:
                if isinstance(item, BaseException):
                    channel.send("error", {"type": type(item).__name__, "message": str(item)})
                    return
                rollout = item.rollout
                rollout.samples = rollout.samples.map(local_rows)
                rollout.metrics = {**rollout.metrics, "rollout/discarded_on_resume": float(self.discarded)}
                channel.send("record", {"index": item.index, "version": item.version, "data_state": item.data_state,
                                        "queued": queued, "idle": idle, "rollout": rollout})
            except ChannelClosed:  # this batch never reached the trainer: the next start says where to go on
                return

    def close(self) -> None:
        self.scorer.close()

