"""Multi-turn episodes on the sampler's slot interface: environments answer between turns, token in, token out.

A batch's rows are episodes (row b*G + g: prompt b's episode g, all G of a group starting from the same
`reset`). `open(batch)` resets their environments (in the worker processes, `jgrpo.envs.workers`) and gives the
batch the prompts the environments opened with; `run(...)` drives the sampler's slot pool:

    state = sampler.start(params, prompts, key)          every episode's first turn starts
    loop, one decode chunk (`sampler.decode_chunk` steps) at a time:
        a slot whose turn ended (a stop id or sampler.max_new_tokens) is paused: its turn goes to its
            environment now (`env.schedule: pool`), or when no slot decodes any more (`turn_sync`);
        at boundary b + env.resume_after (pool; turn_sync: once every environment has answered) the host takes
            the answer, waiting for it if need be (`env/wait_s`), and appends the reply's delta ids to the row
            (`jgrpo.envs.rendering`), or finishes the episode (done, `env.max_turns`, the token budget, a failure);
        sampler.advance(params, state, 1)                meanwhile the other slots decode
    rows = sampler.drain(state)

Resuming at a fixed boundary, not when the answer happens to arrive, makes the schedule, and so every
trajectory, independent of the environments' latency (tested). The record keeps exactly the sampled and
appended ids; the loss mask marks the sampled ones (appended tokens have no log-prob and never train).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time

import jax
import numpy as np

from jgrpo.envs.base import Turn, row_of
from jgrpo.envs.rendering import Renderer
from jgrpo.envs.tool_format import outside_tool_calls, parse_tool_calls
from jgrpo.envs.workers import EnvironmentWorkers
from jgrpo.parallel.host_arrays import gather_json, row_block
from jgrpo.sampling.sampler import Prompts, SampleOutput, Sampler
from jgrpo.sampling.turns import DECODING, DONE, EMPTY, PAUSED

log = logging.getLogger("jgrpo.envs")


def episode_sampler(config, sampler: Sampler) -> Sampler:
    """`sampler` for episodes: a row is the whole episode (env.max_total_tokens), a turn sampler.max_new_tokens."""
    turn = config.sampler.max_new_tokens
    return sampler.replace(max_new_tokens=config.env.max_total_tokens, turn_tokens=turn,
                           append_tokens=config.env.max_append_tokens,
                           decode_chunk=config.sampler.decode_chunk or episode_chunk(turn))


def episode_chunk(turn_tokens: int) -> int:
    """The decode chunk of episodes (`sampler.decode_chunk: 0`): the host sees paused turns only at chunk
    boundaries, so a turn that stops early leaves its slot idle until the next one. A quarter of a turn (at least 8
    steps) bounds that idling to ~25% of a turn for ~4 compiled chunk programs; benchmarks/multiturn.py measures
    it against one chunk per turn."""
    return max(8, -(-turn_tokens // 4))


@dataclasses.dataclass
class Turnaround:
    """A paused turn on its way back: when it rejoins, the reply's ids once the environment answered (None: the
    episode ends), and the slot it kept (None: it gave the slot away)."""

    due: int  # the chunk boundary it rejoins at (or after, when no slot is free)
    stopped: bool  # the turn ended at a stop token
    length: int  # the row's tokens when it paused
    slot: int | None
    answered: bool = False
    ids: list[int] | None = None


@dataclasses.dataclass
class Episode:
    """One row's episode, on the host."""

    id: int  # unique in the run: batch step * rows + row
    transcript: list[dict]  # the messages so far (the assistant's as the text of its turns)
    turns: int = 0
    reward: float = 0.0  # the sum of the environment's per-turn rewards
    final_reward: bool = False  # the last step gave a reward (else reward.functions score the last turn)
    last_text: str = ""  # the last turn's text outside its tool calls
    truncated: bool = False  # ended by env.max_turns, the token budget or a cut reply, not by the environment
    failed: str | None = None  # why the environment failed (the episode follows env.on_failure)
    pauses: int = 0  # turns that waited for the environment and resumed
    stop_id: int | None = None  # the stop token that ended the last turn (None: cut by sampler.max_new_tokens)
    counts: collections.Counter = dataclasses.field(default_factory=collections.Counter)


class EpisodeRunner:
    """Episodes of one run: its environment workers, renderer and the sampler in its multi-turn form."""

    def __init__(self, config, *, sampler: Sampler, tokenizer, workers: EnvironmentWorkers, renderer: Renderer):
        e = config.env
        self.config, self.env, self.tokenizer, self.workers, self.renderer = config, e, tokenizer, workers, renderer
        # A row's N tokens are the whole episode after its prompt; one turn draws at most sampler.max_new_tokens.
        self.sampler = episode_sampler(config, sampler)
        self.group = sampler.num_samples  # the episodes of a prompt (the run's sampler: grpo.num_generations)
        self.opened: dict[int, list[Episode]] = {}  # batch step -> its episodes, between open and run
        self.failure_logged: set[str] = set()

    @classmethod
    def from_config(cls, config, *, sampler: Sampler, tokenizer) -> EpisodeRunner:
        """The run's episodes: its environment built once here (a class that does not import or build is a config
        error now, not at the first episode), its tools rendered per `env.tool_format`, its workers started."""
        from jgrpo.config import ConfigError
        from jgrpo.envs.builtin import environment_class

        e = config.env
        try:
            tools = environment_class(e.name)(config).tools
        except ConfigError:  # a setting of ours (the python tool's sandbox): its own message says what to do
            raise
        except Exception as error:  # the user's environment: its failure is a setup error  # noqa: BLE001
            raise ConfigError(f"env.name={e.name}: the environment does not build: {type(error).__name__}: "
                              f"{error}") from error
        renderer = Renderer(tokenizer, tools=tools, tool_format=e.tool_format, turn_prefix=e.turn_prefix,
                            first_turn_prefix=e.first_turn_prefix)
        return cls(config, sampler=sampler, tokenizer=tokenizer, workers=EnvironmentWorkers(config), renderer=renderer)

    def close(self) -> None:
        self.workers.close()

    def using(self, sampler: Sampler) -> EpisodeRunner:
        """These episodes' environments and renderer, sampled by `sampler` (evaluation: greedy, or k samples)."""
        return EpisodeRunner(self.config, sampler=sampler, tokenizer=self.tokenizer, workers=self.workers,
                             renderer=self.renderer)

    # ------------------------------------------------------------------ reset

    def seed(self, step: int, prompt: int) -> int:
        """The environment seed of a batch's prompt: from the run's seed, the batch and the prompt (so the G
        episodes of a group, and a resumed run, get the same one)."""
        return int(np.random.SeedSequence([self.config.run.seed, step, prompt]).generate_state(1)[0])

    def _first_row(self, rows: int) -> int:
        """The global row of this process's first episode, of its `rows` (process p's are the p-th block)."""
        return row_block(self.sampler.mesh) * rows

    def open(self, batch):
        """`batch` (this process's prompts) with the prompts its environments open with; the episodes wait for
        `run`. Ids and seeds count the run's global rows and prompts, so a run's episodes are the same over any
        number of processes."""
        G, R = self.group, len(batch) * self.group
        first, everyone = self._first_row(R), R * jax.process_count()
        episodes = []
        for b, (question, reference) in enumerate(zip(batch.questions, batch.references, strict=True)):
            for g in range(G):
                episodes.append(Episode(batch.step * everyone + first + b * G + g, []))
                self.workers.submit(episodes[-1].id, "reset", row_of(question, reference),
                                    self.seed(batch.step, first // G + b))
        token_ids, texts = list(batch.token_ids), list(batch.texts)
        for b in range(len(batch)):
            group = episodes[b * G:(b + 1) * G]
            outcomes = [self.workers.result(ep.id) for ep in group]
            opening = next((o.value for o in outcomes if o.error is None), None)
            for ep, o in zip(group, outcomes, strict=True):
                if o.error is not None or o.value != opening:
                    self._fail(ep, o.error or "reset gave other messages than its group's first episode (same row "
                                              "and seed)", "reset")
            if opening is None:  # the whole group failed: it samples from the data's prompt, masked
                continue
            transcript, ids = self.renderer.prompt(opening)
            if len(ids) > self.config.data.max_prompt_length:
                for ep in group:
                    self._fail(ep, f"the opening prompt has {len(ids)} tokens, over data.max_prompt_length="
                                   f"{self.config.data.max_prompt_length}", "reset")
                continue
            for ep in group:
                ep.transcript = [dict(m) for m in transcript]
            token_ids[b], texts[b] = ids, self.tokenizer.decode(ids)
        self.opened[batch.step] = episodes
        return dataclasses.replace(batch, token_ids=token_ids, texts=texts)

    # ------------------------------------------------------------------ the turns

    def run(self, params, prompts: Prompts, batch, key, version: int = 0) -> tuple[SampleOutput, list[Episode]]:
        """The opened episodes of `batch`, played to the end: their rows (numpy, [R, N] / [R]) and episodes.

        With fewer slots than episodes (`sampler.slots`) and `env.schedule: pool`, a paused episode gives its slot
        to the next episode (`Sampler.park`) and rejoins in a free slot of its queue (`Sampler.resume`, lowest
        slot first, episodes in the order they became due); otherwise it keeps its slot (`Sampler.append`).

        With several processes each plays its own rows' episodes (their environments run on its host) and every
        process drives the one slot pool alike: the pool's status is read on every host, and the answers due at
        a boundary are exchanged before anyone appends (`gather_json`), so every process makes the same calls.
        The rows returned are this process's."""
        episodes = self.opened.pop(batch.step)
        sampler, env = self.sampler, self.env
        first, everyone = self._first_row(len(episodes)), len(episodes) * jax.process_count()
        mine = range(first, first + len(episodes))  # this process's rows, of the pool's global ones
        turn_sync = env.schedule == "turn_sync"
        handoff = not turn_sync and sampler.slots is not None and sampler.slots < everyone
        state = sampler.start(params, prompts, key, version)
        waiting: dict[int, Turnaround] = {}  # row -> its turn's way back
        boundary, wait_s = 0, 0.0
        while True:
            status = state.status()
            decoding = (status.state == DECODING).any()
            newly = [s for s in np.flatnonzero(status.state == PAUSED) if int(status.row[s]) not in waiting]
            if newly and not (turn_sync and decoding):
                turns = state.turns()
                for slot in newly:
                    row, end, stopped = int(status.row[slot]), int(status.length[slot]), bool(status.stopped[slot])
                    if row in mine:
                        self._submit(episodes[row - first], turns[slot, :int(status.turn_length[slot])], stopped)
                    if handoff:
                        state, _ = sampler.park(state, int(slot))
                    waiting[row] = Turnaround(boundary + env.resume_after, stopped, end, None if handoff else int(slot))
                status = state.status()
            due = sorted((t.due, row) for row, t in waiting.items()
                         if (not decoding if turn_sync else t.due <= boundary))
            wait_s += self._answer_due([row for _, row in due], waiting, episodes, mine)
            free = [int(s) for s in np.flatnonzero((status.state == DONE) | (status.state == EMPTY))]
            for _, row in due:
                t = waiting[row]
                if t.slot is not None:  # it kept its slot
                    state = (sampler.finish(state, t.slot) if t.ids is None else
                             sampler.append(params, state, t.slot, t.ids, version))
                elif t.ids is None:
                    state = sampler.finish_row(state, row)
                else:
                    plan = state.spec.plan
                    slot = next((s for s in free if s // plan.slots_per_queue == row // plan.rows_per_queue), None)
                    if slot is None:
                        continue  # no free slot in its queue yet: the next boundary
                    free.remove(slot)
                    state = sampler.resume(params, state, slot, row, t.ids, version)
                if row in mine:
                    episodes[row - first].pauses += t.ids is not None
                del waiting[row]
            # (A turn that ends at its first token, a stop id, pauses again as it is appended: not done yet.)
            if not waiting and state.idle() and not (state.status().state == PAUSED).any():
                break
            state = sampler.advance(params, state, 1, version)
            boundary += 1
        rows, out, state = sampler.drain(state)
        if len(rows) != everyone:
            raise RuntimeError(f"{everyone - len(rows)} episodes did not complete")  # a bug, not bad input
        out = out.map(lambda x: x[first:first + len(episodes)])  # every row is complete: row r is at r
        for ep, truncated in zip(episodes, out.truncated, strict=True):
            ep.truncated = ep.truncated or (bool(truncated) and not ep.final_reward)
        episodes[0].counts["wait_s"] += wait_s
        self.workers.forget(ep.id for ep in episodes)
        return out, episodes

    def _answer_due(self, rows: list[int], waiting: dict[int, Turnaround], episodes: list[Episode],
                    mine: range) -> float:
        """The replies' ids of the due turns not answered yet (None: the episode ends), from this process's
        environments for its rows and, with several processes, from the others' for theirs. Returns the seconds
        spent waiting for them."""
        rows = [row for row in rows if not waiting[row].answered]
        if not rows:  # the same on every process: the exchange below is a collective
            return 0.0
        answers, waited = {}, 0.0
        for row in rows:
            if row in mine:
                ep, t = episodes[row - mine.start], waiting[row]
                start = time.perf_counter()
                reply = self._answer(ep)
                waited += time.perf_counter() - start
                ids = None if reply is None else self._delta(ep, reply, t.stopped, t.length)
                answers[row] = None if ids is None else [int(i) for i in ids]
        if jax.process_count() > 1:
            start = time.perf_counter()
            answers = {row: ids for part in gather_json(list(answers.items())) for row, ids in part}
            waited += time.perf_counter() - start
        for row in rows:
            waiting[row].ids, waiting[row].answered = answers[row], True
        return waited

    def _submit(self, ep: Episode, ids: np.ndarray, stopped: bool) -> None:
        """A turn ended: read it, and hand it to its environment (unless the episode failed already)."""
        text = self.renderer.turn_text(ids, stopped, first=ep.turns == 0)
        calls, error = parse_tool_calls(text)
        turn = Turn(ep.turns, tuple(int(i) for i in ids), text, tuple(calls), error, not stopped)
        ep.transcript.append({"role": "assistant", "content": text})
        ep.turns += 1
        ep.last_text = outside_tool_calls(text)  # what reward.functions score when the episode ends here
        ep.stop_id = int(ids[-1]) if stopped else None
        if ep.failed is None:
            self.workers.submit(ep.id, "step", turn)

    def _answer(self, ep: Episode):
        """The environment's reply to the turn (None: the episode ends here)."""
        if ep.failed is not None:
            return None
        outcome = self.workers.result(ep.id)
        if outcome.error is not None:
            self._fail(ep, outcome.error)
            return None
        result = outcome.value
        ep.counts.update({k: v for k, v in (result.info or {}).items()})
        ep.final_reward = result.reward is not None
        ep.reward += result.reward or 0.0
        if result.done:
            return None
        if ep.turns >= self.env.max_turns:
            ep.truncated = True
            return None
        return result.reply

    def _delta(self, ep: Episode, reply, stopped: bool, length: int) -> list[int] | None:
        """The ids appended after the turn, or None when they do not fit the episode's budget (truncated)."""
        ids, cut = self.renderer.delta_within(reply, ep.stop_id if stopped else None, self.env.max_append_tokens)
        ep.counts["replies_cut"] += int(cut)
        if not (reply and all(isinstance(x, int) for x in reply)):
            self.renderer.check_append_only(ep.transcript, reply)
            ep.transcript.extend(dict(m) for m in reply)
        if len(ids) + 1 > self.env.max_total_tokens - int(length):  # the next turn draws at least one token
            ep.truncated = True
            return None
        return ids

    def _fail(self, ep: Episode, why: str, kind: str | None = None) -> None:
        if ep.failed is not None:
            return
        ep.failed = why
        kind = kind or ("timeout" if "timeout_s" in why else "worker" if "worker" in why else
                        "reset" if why.startswith("reset") else "step")
        ep.counts[f"failures/{kind}"] += 1
        if kind not in self.failure_logged:
            self.failure_logged.add(kind)
            log.warning("an environment failed (episode %d, env.on_failure=%s; logged once per kind): %s", ep.id,
                        self.env.on_failure, why)
