"""The prompt iterator the trainer consumes: shuffled epochs of batches, sharded by process, resumable.

Order: each epoch is a fresh seeded shuffle of all prompts (grain reseeds its shuffle per epoch); global
batch k of an epoch is prompts [k*B, (k+1)*B) of that order, and process p of P takes the p-th contiguous
slice of B/P prompts. So the global sequence of batches depends only on the data, seed and B, never on
the number of processes, and the processes together see every prompt of a batch exactly once.
The iterator's state is a small JSON-able dict; restoring it reproduces the following batches exactly.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math

import grain
import numpy as np

from jgrpo.config import Config, DataConfig
from jgrpo.config.errors import ConfigError, DataError
from jgrpo.data.formats import Example, rows_to_examples
from jgrpo.data.prompts import PromptEncoder
from jgrpo.data.sources import BUILTIN_TASKS, read_rows
from jgrpo.data.tasks import arithmetic_examples, countdown_examples
from jgrpo.data.word_problems import word_problem_examples

log = logging.getLogger("jgrpo.data")


@dataclasses.dataclass(frozen=True)
class PromptBatch:
    """This process's share of one global batch of prompts."""

    token_ids: list[list[int]]  # [B_local] unpadded prompt token ids (chat template applied)
    texts: list[str]  # [B_local] prompt texts as the model sees them
    questions: list[str]  # [B_local] the bare questions
    references: list[dict]  # [B_local] reference fields for the rewards ("answer", "numbers", "target", ...)
    epoch: int  # 0-based epoch of these prompts (the trainer swaps the reference model when it changes)
    step: int  # 0-based index of this batch in the whole run

    def __len__(self) -> int:
        return len(self.token_ids)


class PromptIterator:
    """Iterator of PromptBatch over `epochs` epochs; `get_state()` / `set_state()` for checkpoints."""

    def __init__(self, records: list[dict], *, batch_size: int, seed: int, epochs: int, shuffle: bool = True,
                 drop_remainder: bool = True, process_index: int = 0, process_count: int = 1,
                 stats: dict | None = None):
        if batch_size % process_count:
            raise ConfigError(f"data.batch_size={batch_size} must be divisible by the {process_count} processes")
        if not 0 <= process_index < process_count:
            raise ValueError(f"process_index={process_index} is not in [0, {process_count})")
        n = len(records)
        self.batches_per_epoch = n // batch_size if drop_remainder else math.ceil(n / batch_size)
        if self.batches_per_epoch == 0:
            raise DataError(f"only {n} prompts, fewer than one batch of data.batch_size={batch_size}: lower "
                            "data.batch_size or give more data")
        self.batch_size, self.process_index, self.process_count = batch_size, process_index, process_count
        self.stats = dict(stats or {}, prompts=n, batches_per_epoch=self.batches_per_epoch, epochs=epochs)
        self._fingerprint = {
            "prompts": n, "batch_size": batch_size, "seed": seed, "epochs": epochs, "shuffle": shuffle,
            "drop_remainder": drop_remainder,
            "content": hashlib.blake2b("\x00".join(r["text"] for r in records).encode(), digest_size=8).hexdigest(),
        }
        ordered = grain.MapDataset.source(records)
        if shuffle:
            ordered = ordered.shuffle(seed=seed)
        ordered = ordered.repeat(epochs)  # reseeds the shuffle every epoch

        def make_batch(step: int) -> PromptBatch:
            epoch, k = divmod(step, self.batches_per_epoch)
            start = k * batch_size
            stop = min(start + batch_size, n)
            # np.array_split's rule: full batches split evenly, a short last batch as evenly as possible.
            share = np.array_split(np.arange(start, stop), process_count)[process_index]
            items = [ordered[epoch * n + int(i)] for i in share]
            return PromptBatch([r["token_ids"] for r in items], [r["text"] for r in items],
                               [r["question"] for r in items], [r["reference"] for r in items], epoch, step)

        steps = grain.MapDataset.range(epochs * self.batches_per_epoch).map(make_batch)
        # No read-ahead threads: a batch costs a few list lookups, and the state then is simply the next step.
        self._iter = iter(steps.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)))

    def __len__(self) -> int:
        return self.batches_per_epoch * self.stats["epochs"]

    def __iter__(self) -> PromptIterator:
        return self

    def __next__(self) -> PromptBatch:
        return next(self._iter)

    def get_state(self) -> dict:
        """JSON-serialisable position (plus a fingerprint of the data and settings it belongs to)."""
        return {"grain": self._iter.get_state(), "fingerprint": dict(self._fingerprint)}

    def set_state(self, state: dict) -> None:
        """Continue from a `get_state()` result; refuses a state that belongs to other data or settings."""
        self.check_state(state)
        self._iter.set_state(state["grain"])

    def check_state(self, state: dict) -> None:
        """Refuse (DataError, naming what differs) a `get_state()` result of other data or settings."""
        theirs = state.get("fingerprint", {})
        differ = sorted(k for k in self._fingerprint if theirs.get(k) != self._fingerprint[k])
        if differ:
            detail = ", ".join(f"{k}: saved {theirs.get(k)!r} vs now {self._fingerprint[k]!r}" for k in differ)
            raise DataError(f"the run directory's checkpoint was written with other data or data settings ({detail}):"
                            " resume with the same data.* settings, or choose a new run.output_dir")


def load_examples(data: DataConfig, split: str | None = None) -> tuple[list[Example], int]:
    """(examples, bad rows skipped) of `data.source` for `split` (default data.split), before tokenization."""
    split = data.split if split is None else split
    if data.source in BUILTIN_TASKS:
        count = data.num_examples if split == "train" else data.num_test_examples
        if data.source == "arithmetic":
            return arithmetic_examples(digits=data.arithmetic_digits, operators=data.arithmetic_operators,
                                       split=split, count=count, seed=data.task_seed), 0
        if data.source == "word_problems":
            return word_problem_examples(split=split, count=count, seed=data.task_seed), 0
        return countdown_examples(num_numbers=data.countdown_numbers, split=split, count=count,
                                  seed=data.task_seed), 0
    return rows_to_examples(read_rows(data.source, split), data)


def build_prompt_iterator(config: Config | DataConfig, tokenizer, *, split: str | None = None,
                          process_index: int | None = None, process_count: int | None = None,
                          shuffle: bool = True, epochs: int | None = None,
                          drop_remainder: bool = True) -> PromptIterator:
    """The trainer's entry point: data config + tokenizer -> PromptIterator for this process.

    For evaluation use split="test", shuffle=False, epochs=1, drop_remainder=False (the last batch may then
    be short). process_index / process_count default to JAX's.
    """
    data = config.data if isinstance(config, Config) else config
    if process_index is None or process_count is None:
        import jax

        process_index = jax.process_index() if process_index is None else process_index
        process_count = jax.process_count() if process_count is None else process_count
    examples, skipped = load_examples(data, split)
    encoder = PromptEncoder(tokenizer, max_length=data.max_prompt_length, system_prompt=data.system_prompt,
                            instruction_suffix=data.instruction_suffix, truncate=data.truncate_long_prompts)
    records, dropped, truncated = encoder.encode(examples)
    limit = f"data.max_prompt_length={data.max_prompt_length} tokens"
    if dropped and not records:
        raise DataError(f"every prompt of data.source={data.source!r} ({split or data.split} split) is longer than "
                        f"{limit} (the first: {dropped[0]}); raise data.max_prompt_length or set "
                        "data.truncate_long_prompts=true")
    if dropped:
        log.warning("dropped %d of %d prompts longer than %s; the first: %s", len(dropped), len(examples), limit,
                    dropped[0])
    stats = {"skipped_bad_rows": skipped, "dropped_long_prompts": len(dropped), "truncated_prompts": truncated}
    return PromptIterator(records, batch_size=data.batch_size, seed=data.shuffle_seed,
                          epochs=data.epochs if epochs is None else epochs, shuffle=shuffle,
                          drop_remainder=drop_remainder, process_index=process_index,
                          process_count=process_count, stats=stats)
