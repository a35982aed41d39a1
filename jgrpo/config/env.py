"""The `env` section: multi-turn episodes with an environment (jgrpo/envs, jgrpo/rollout/episodes.py)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from jgrpo.config.errors import check as _check

BUILTIN_ENVIRONMENTS = ("none", "calculator", "guess_number")
BUILTIN_TOOLS = ("calculator", "python")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EnvConfig:
    # none: single-turn GRPO (one completion per row). calculator, guess_number: the built-in environments;
    # module:Class: an Environment subclass of your own (docs/environments.md). With an environment a row is an
    # episode of several assistant turns, each answered by the environment; only the sampled tokens train.
    name: str = "none"
    # The tools the model is told about: calculator, python (null: the environment's own; calculator: [calculator]).
    tools: tuple[str, ...] | None = None
    # How tools are shown: hermes (JSON schemas in the system prompt, <tool_call> JSON calls), template (the chat
    # template's own tools rendering, Qwen2.5/Qwen3), auto (template when the template renders tools).
    tool_format: Literal["auto", "hermes", "template"] = "auto"
    # Text the model is given at the start of each of its turns (appended, not sampled, not trained on).
    turn_prefix: str = ""
    # The first turn's instead (null: turn_prefix): e.g. the opening of a tool call, so that a model that never
    # calls a tool by itself starts with one and learns the rest (configs/quickstart_tools.yaml).
    first_turn_prefix: str | None = None
    # pool: a slot whose turn ends pauses while the others decode; its environment answers meanwhile and the
    # episode rejoins resume_after chunks later. turn_sync: every episode finishes its turn, all environments
    # step, the next turn starts (the baseline; same trajectories).
    schedule: Literal["pool", "turn_sync"] = "pool"
    # pool: an episode paused at a chunk boundary b rejoins at b + resume_after (the host waits there for a slow
    # environment), so trajectories do not depend on how fast the environment answered. 0: at b itself (nothing
    # decodes while the environments answer: for tools that answer in microseconds).
    resume_after: int = 1
    max_turns: int = 4  # assistant turns per episode; past it the episode ends, marked truncated
    # Tokens of an episode after its prompt (sampled and appended together): the row width the trainer sees and
    # the sampler's cache length. sampler.max_new_tokens is the budget of one turn.
    max_total_tokens: int = 1024
    max_append_tokens: int = 256  # longest environment reply in tokens; a longer one is cut, marked [truncated]
    num_workers: int = 2  # processes the environments run in (0: in the trainer's process, no timeout)
    timeout_s: float = 30.0  # an environment's reset or step running longer fails its episode
    # A failed episode (the environment raised, hung past timeout_s, or its worker died): mask leaves it out of
    # the loss and of its group's statistics; zero_reward keeps it with reward 0. Counted in env/failures/*.
    on_failure: Literal["mask", "zero_reward"] = "mask"
    # python tool: where the model's code runs. bwrap: inside bubblewrap, each call in namespaces of its own with
    # read-only binds of only the interpreter and sandbox_packages, a fresh /tmp of sandbox_disk_mb, no network,
    # an unprivileged uid (docs/environments.md, Tools). auto: bwrap where it runs, else the tool is refused at
    # start (saying what to install). process: a plain subprocess with the limits below only (logged once).
    sandbox: Literal["auto", "bwrap", "process"] = "auto"
    sandbox_disk_mb: int = 64  # python tool: the writable /tmp (its working directory), in MB of memory (tmpfs)
    # python tool: the installed distributions the code may import (with what they require), e.g. [numpy, sympy];
    # [] offers the standard library only. jgrpo and the trainer's other packages are never there.
    sandbox_packages: tuple[str, ...] = ()
    sandbox_read_only: tuple[str, ...] = ()  # python tool: more paths it may read (a task's data), bound read-only
    sandbox_cpu_s: int = 5  # python tool: CPU seconds per call (RLIMIT_CPU)
    sandbox_memory_mb: int = 512  # python tool: address space (RLIMIT_AS)
    sandbox_file_mb: int = 16  # python tool: largest file it may write (RLIMIT_FSIZE)
    sandbox_processes: int = 0  # python tool: extra processes it may start (RLIMIT_NPROC above the current count)
    sandbox_output_chars: int = 4000  # python tool: output kept; longer output is cut, marked [truncated]
    sandbox_timeout_s: float = 10.0  # python tool: wall-clock limit per call

    def __post_init__(self):
        _check(self.name in BUILTIN_ENVIRONMENTS or ":" in self.name, "env.name", self.name,
               f"one of {', '.join(BUILTIN_ENVIRONMENTS)} or module:Class")
        unknown = [t for t in self.tools or () if t not in BUILTIN_TOOLS]
        _check(not unknown, "env.tools", list(self.tools or ()),
               f"a list of the built-in tools {', '.join(BUILTIN_TOOLS)} (unknown: {', '.join(unknown)})")
        _check(self.resume_after >= 0, "env.resume_after", self.resume_after, ">= 0 chunks")
        _check(self.max_turns >= 1, "env.max_turns", self.max_turns, "a positive integer")
        _check(self.max_total_tokens >= 2, "env.max_total_tokens", self.max_total_tokens, ">= 2")
        _check(self.max_append_tokens >= 1, "env.max_append_tokens", self.max_append_tokens, "a positive integer")
        _check(self.num_workers >= 0, "env.num_workers", self.num_workers, ">= 0 (0: in the trainer's process)")
        _check(self.timeout_s > 0, "env.timeout_s", self.timeout_s, "a positive number of seconds")
        for key in ("sandbox_cpu_s", "sandbox_memory_mb", "sandbox_file_mb", "sandbox_output_chars", "sandbox_disk_mb"):
            _check(getattr(self, key) > 0, f"env.{key}", getattr(self, key), "a positive number")
        _check(self.sandbox_processes >= 0, "env.sandbox_processes", self.sandbox_processes, ">= 0")
        _check(self.sandbox_timeout_s > 0, "env.sandbox_timeout_s", self.sandbox_timeout_s, "a positive number")

    @property
    def on(self) -> bool:
        return self.name != "none"
