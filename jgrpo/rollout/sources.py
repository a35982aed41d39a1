"""Where each iteration's scored samples come from (`rollout.mode`): the prompt batches, their keys, the sampler.

- `sync`: the trainer samples an iteration's batch when it reaches that iteration.
- `window` (fixed v > 1): at a behaviour refresh, the batches of the v iterations that behaviour policy serves
  are drawn at once and sampled in one slot pool (`sampler.slots`, default one iteration's rows), so no slot
  idles between iterations and one batch's long tail overlaps the next batch's start. This is the paper's
  Algorithm 1 exactly: the same behaviour params sample the same prompts with the same keys, so the tokens are
  those `sync` draws (tested). On devices that train as well, XLA runs one program at a time: the gain is the
  fuller pool, not an overlap of sampling and training.

Keys: iteration k samples with `fold_in(sample_root, k)`, and sample g of prompt b of its batch draws token t
with `fold_in(fold_in(that, b * G + g), t)` (`slot_decoding.sample`): keyed by (iteration, prompt, sample, step),
never by the order of sampling, so a window and the iterations one at a time give the same tokens.

Checkpoints in `window` mode keep the prompt iterator's state at the window's start: a run resumed inside a
window draws the window's batches again, samples the whole window again (same params, keys and shapes: the
same bits) and skips the iterations it already trained on. A new epoch's reference swap happens when the
trainer reaches that epoch's batch (`Trainer._enter_epoch`), not when the window reads ahead.
"""

from __future__ import annotations

import collections
import logging
import time

import jax
import numpy as np

from jgrpo.data import bucketed_length
from jgrpo.parallel.host_arrays import global_max, local_rows, row_block, to_global_rows
from jgrpo.parallel.mesh import SAMPLE_RULES
from jgrpo.rollout.records import Rollout
from jgrpo.rollout.scoring import Scoring, prompt_arrays, sample_and_score
from jgrpo.sampling.sampler import Prompts, Sampler

log = logging.getLogger(__name__)

SAMPLE_STREAM = 0x53414D50  # folded into the run's seed: the sample keys' own stream, apart from the rng's


class DataExhausted(RuntimeError):
    """The prompt iterator has no batch left (data.epochs epochs consumed)."""


def sample_root(seed: int) -> jax.Array:
    """The root of every iteration's sample key (host-local; `Trainer` keeps a mesh-replicated copy)."""
    return jax.random.fold_in(jax.random.key(seed), SAMPLE_STREAM)


class RolloutSource:
    """The trainer's prompts and samples: batches from the data iterator, padded, sampled and scored."""

    def __init__(self, config, *, data, sampler: Sampler, scoring: Scoring, root, episodes=None):
        self.config, self.data, self.sampler, self.scoring = config, data, sampler, scoring
        self.episodes = episodes  # an EpisodeRunner with env.name set: rows are multi-turn episodes
        self.pad_id, self.mesh = sampler.pad_id, sampler.mesh
        self.root = root  # mesh-replicated sample_root(run.seed)
        self.window: collections.deque[Rollout] = collections.deque()  # sampled batches not trained on yet
        self.window_start = None  # the iterator's state before the current window's batches

    def sample_key(self, iteration: int) -> jax.Array:
        return jax.random.fold_in(self.root, iteration)

    def next_batch(self, iteration: int):
        """The next batch of prompts (with an environment: the prompts its episodes open with)."""
        try:
            return self._opened(next(self.data))
        except StopIteration:
            raise DataExhausted(f"the prompt data is exhausted after {iteration} iterations "
                                f"(data.epochs={self.config.data.epochs}); raise data.epochs") from None

    def prompt_arrays(self, batch, counters, mesh=None):
        """`batch` padded to the run's prompt width (which only grows: `counters.prompt_width`), as global arrays
        on `mesh` (default the sampler's)."""
        c = self.config
        longest = max(len(ids) for ids in batch.token_ids)
        width = global_max(max(counters.prompt_width, bucketed_length(longest, c.sampler.prompt_bucket)))
        if counters.prompt_width and width > counters.prompt_width:
            log.warning("prompt width grows from %d to %d tokens: the step functions compile again",
                        counters.prompt_width, width)
        counters.prompt_width = width
        return prompt_arrays(batch.token_ids, width=width, pad_id=self.pad_id, mesh=mesh or self.mesh,
                             global_prompts=c.data.batch_size)

    def _opened(self, batch):
        return batch if self.episodes is None else self.episodes.open(batch)

    def sample(self, params, batch, prompts: Prompts, key, version: int = 0) -> Rollout:
        """`batch` sampled with `params` (of `version`) and `key`, and scored (episodes: played to the end)."""
        if self.episodes is None:
            return sample_and_score(self.sampler, params, prompts, batch, key, self.scoring, version)
        start = time.perf_counter()
        out, episodes = self.episodes.run(params, prompts, batch, key, version)
        return self.scoring.score_episodes(out, episodes, batch, self.mesh, self.config.env.on_failure,
                                           time.perf_counter() - start)

    def first(self, params, iteration: int, counters, version: int = 0) -> Rollout:
        """Iteration `iteration`'s batch, sampled with `params` (the behaviour policy) and scored."""
        if self.config.rollout.mode == "sync":
            batch = self.next_batch(iteration)
            return self.sample(params, batch, self.prompt_arrays(batch, counters), self.sample_key(iteration), version)
        if not self.window:
            v = self.config.grpo.behaviour_refresh
            first = iteration - iteration % v  # a resumed run starts inside a window: sample all of it again
            self.window_start = self.data.get_state()
            batches = []
            for _ in range(v):
                try:
                    batches.append(self._opened(next(self.data)))
                except StopIteration:
                    break
            if len(batches) <= iteration - first:
                raise DataExhausted(f"the prompt data is exhausted after {iteration} iterations "
                                    f"(data.epochs={self.config.data.epochs}); raise data.epochs")
            if self.episodes is None:
                self.window.extend(self._sample_window(params, batches, first, version)[iteration - first:])
            else:  # episodes: one slot pool per batch, each with its iteration's key (the tokens sync samples)
                self.window.extend(self.sample(params, b, self._window_prompts(b), self.sample_key(first + j), version)
                                   for j, b in enumerate(batches) if j >= iteration - first)
        return self.window.popleft()

    def _window_prompts(self, batch) -> Prompts:
        c = self.config
        longest = max(len(ids) for ids in batch.token_ids)
        return prompt_arrays(batch.token_ids, width=global_max(bucketed_length(longest, c.sampler.prompt_bucket)),
                             pad_id=self.pad_id, mesh=self.mesh, global_prompts=c.data.batch_size)

    def data_state(self) -> dict:
        """The iterator state a checkpoint keeps: inside a window, the window's start (its batches are in flight)."""
        return self.window_start if self.window else self.data.get_state()

    def set_data_state(self, state: dict) -> None:
        self.data.set_state(state)
        self.window.clear()

    def _sample_window(self, params, batches, first: int, version: int) -> list[Rollout]:
        """Batches of iterations first, first + 1, ... sampled in one slot pool; one scored Rollout per batch."""
        c, G = self.config, self.config.grpo.num_generations
        B, local = c.data.batch_size, len(batches[0])
        start = time.perf_counter()
        longest = max(len(ids) for b in batches for ids in b.token_ids)
        tokens, mask, _ = prompt_arrays([ids for b in batches for ids in b.token_ids],
                                        width=global_max(bucketed_length(longest, c.sampler.prompt_bucket)),
                                        pad_id=self.pad_id, mesh=self.mesh, global_prompts=len(batches) * B)
        # Each prompt's iteration key and its index in that iteration's global batch, next to it on its process.
        keys = np.concatenate([np.repeat(np.asarray(jax.random.key_data(jax.random.fold_in(sample_root(
            c.run.seed), first + j)))[None], local, axis=0) for j in range(len(batches))])
        index = np.tile(row_block(self.mesh) * local + np.arange(local), len(batches))
        rows = len(batches) * B * G
        index = to_global_rows(index.astype(np.int32), self.mesh, SAMPLE_RULES, len(batches) * B)
        pool = self.sampler.replace(slots=c.sampler.slots or B * G)  # one iteration's rows decode at once
        out = pool.generate(params, Prompts(tokens, mask, index),
                            to_global_rows(keys, self.mesh, SAMPLE_RULES, len(batches) * B), version)
        fields = jax.block_until_ready(out).map(local_rows)  # this process's rows, batch after batch
        seconds = time.perf_counter() - start
        per_batch = local * G
        rollouts = []
        for j, batch in enumerate(batches):
            part = fields.map(lambda x, j=j: x[j * per_batch:(j + 1) * per_batch])
            samples = part.map(lambda x: to_global_rows(x, self.mesh, SAMPLE_RULES, rows // len(batches)))
            rollouts.append(self.scoring.score(samples, batch, part.tokens, part.lengths, seconds if j == 0 else 0.0))
        return rollouts
