"""The sampler engine: a `Sampler` holds what every sampling call repeats (the model definition, how a token is
drawn, stop and pad ids, the mesh and its rules, max new tokens, slots, the page cache's settings) and samples G
completions per prompt with any params of the model: a whole batch at once (`generate`), or slot by slot, with
rows paused between turns (`start`, `advance`, `append`, `finish`, `drain`, and `park` / `resume` / `finish_row`
for a row that gives its slot away while it waits: `jgrpo.sampling.turns`). `lower` gives the planner the program
`generate` runs.

One jitted program per (prompt batch shape, samples per prompt, max new tokens, slots, pages, method, stop ids):
the prompts are prefilled once into pages their G rows share, then the rows decode in a `lax.while_loop`, each
slot taking the next waiting row when its row stops (`jgrpo.sampling.decode_loop`). By default there is one slot
per row; `slots` < rows bounds the rows decoding at once, and `kv_pages` the pages they may hold
(docs/configuration.md, `sampler.slots`, `sampler.kv_pages`).

The cache never leaves the jitted program (it is created and consumed inside), so there is no host-visible buffer
to donate and no cache-sized copy per call. Prompts longer than allowed are rejected (or left-truncated) by
`left_pad_prompts` before that.

Randomness: row r draws its token t with `fold_in(fold_in(key, r), t)`. A row's tokens depend only on
the key, its global row index and the model, not on the batch sharding, the slot count or the pages.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jgrpo.config import SamplerConfig
from jgrpo.models.attention_backends import mesh_context_factory
from jgrpo.models.llm import abstract_model, model_config, param_logical_axes
from jgrpo.models.paged_attention import resolve_paged_attention
from jgrpo.models.quantize import quantized, with_int8, without_scales
from jgrpo.parallel.mesh import SAMPLE_RULES, Rules, logical_shardings, replicated
from jgrpo.sampling import stream, turns
from jgrpo.sampling.decode_loop import sample
from jgrpo.sampling.layout import plan_and_layout, platform
from jgrpo.sampling.methods import SamplingMethod
from jgrpo.sampling.state import PoolSpec, SampleOutput

__all__ = ["Prompts", "SampleOutput", "Sampler", "SamplingMethod", "stop_ids_for"]

# Tokens that close a turn in the chat templates of the supported families (besides the EOS id).
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|endoftext|>", "<end_of_turn>")


def stop_ids_for(tokenizer, extra: Sequence[int] = ()) -> tuple[int, ...]:
    """The tokenizer's EOS id, every end-of-turn token its vocabulary has, and `extra`; sorted, unique."""
    ids = set(int(i) for i in extra)
    eos = tokenizer.eos_token_id
    ids.update([eos] if isinstance(eos, int) else list(eos or ()))
    vocab = tokenizer.get_vocab()
    ids.update(vocab[t] for t in END_OF_TURN_TOKENS if t in vocab)
    if not ids:
        raise ValueError("the tokenizer has no EOS or end-of-turn token; pass stop ids explicitly")
    return tuple(sorted(ids))


def _typed(key):
    """A raw uint32 key (`jax.random.PRNGKey`) as a typed key, so one key and [B] keys cannot be confused."""
    return key if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else jax.random.wrap_key_data(key)


def _check_prompts(prompt_tokens, prompt_mask) -> int | None:
    """Validate shapes and left padding; return the longest real prompt (None if not visible here)."""
    if prompt_tokens.ndim != 2 or prompt_tokens.shape != prompt_mask.shape:
        raise ValueError(
            f"prompt_tokens {prompt_tokens.shape} and prompt_mask {prompt_mask.shape} must both be [B, P]"
        )
    if isinstance(prompt_mask, jax.Array) and not prompt_mask.is_fully_addressable:
        return None  # multi-process global array: each process validated its own rows when it built them
    mask = np.asarray(prompt_mask, bool)
    if not mask[:, -1].all():
        bad = np.flatnonzero(~mask[:, -1]).tolist()
        raise ValueError(f"prompts {bad} do not end at the last column: prompts must be left-padded and non-empty")
    if (np.diff(mask.astype(np.int8), axis=1) < 0).any():
        raise ValueError("prompt_mask has padding after a real token: prompts must be left-padded")
    return int(mask.sum(axis=1).max())


class Prompts(NamedTuple):
    """B left-padded prompts: `tokens` [B, P] int32 and `mask` [B, P] bool (numpy, or global arrays on the mesh).
    `index` [B] int32, optional: each prompt's index in its own batch, when prompts of several batches are sampled
    together, each with its batch's key (then `key` is [B] keys): they get the tokens their own batch would get."""

    tokens: Any
    mask: Any
    index: Any = None


@dataclasses.dataclass(frozen=True)
class Sampler:
    """Samples `num_samples` completions of every prompt with any params of one model; rows b*G .. b*G+G-1 belong
    to prompt b. Holds what every call repeats; `replace(...)` gives a sampler with other options.

    With a `mesh`, rows are sharded over the batch axes and heads over tensor (`rules`, the sampling rules);
    params in another layout (e.g. the FSDP training layout) are resharded first, once per call, and params
    already in the sampling layout are used as they are. `slots` bounds the rows decoding at once (None: all of
    them), `kv_pages` the pages of each queue's pool (0: enough for every slot's row at its longest, so nothing is
    ever preempted), `page_size` the tokens of a page (None: by platform), `decode_layers` whether the decode step
    unrolls the layers or scans them (`models.decode_step`), `paged_attention` its attention's implementation
    (`models.paged_attention`), `shrink` how often `generate` may halve its slots as rows finish (None: by
    platform), `decode_chunk` how many steps the slot interface decodes between returns to the host. These change
    speed, memory and compile time, the samples at most by float rounding. `kv_cache_dtype` does change them
    ("int8": models/kv_quant.py). `cfg` is the model's LLMConfig (None: read from the params at each call).
    """

    graphdef: Any
    max_new_tokens: int
    method: SamplingMethod = SamplingMethod()
    num_samples: int = 1
    stop_ids: tuple[int, ...] = ()
    pad_id: int = 0
    mesh: Mesh | None = None
    rules: Rules = dataclasses.field(default_factory=lambda: SAMPLE_RULES)
    slots: int | None = None
    kv_pages: int = 0
    page_size: int | None = None
    decode_chunk: int | None = None
    decode_layers: str = "auto"
    paged_attention: str = "auto"  # "xla" or "pallas" (`models.paged_attention`); "auto": by the platform
    shrink: int | None = None
    kv_cache_dtype: str = "auto"  # "auto" (the model's compute dtype), "float32", "bfloat16" or "int8"
    cfg: Any = None
    turn_tokens: int | None = None  # the slot interface: tokens a turn may draw (None: max_new_tokens)
    append_tokens: int | None = None  # the slot interface: ids one append may take (None: max_new_tokens)

    def __post_init__(self):
        if self.num_samples < 1 or self.max_new_tokens < 1:
            raise ValueError(f"num_samples={self.num_samples} and max_new_tokens={self.max_new_tokens} must be "
                             "positive")
        if not isinstance(self.method, SamplingMethod):
            raise TypeError(f"method must be a SamplingMethod, got {type(self.method).__name__}")
        object.__setattr__(self, "stop_ids", tuple(sorted({int(i) for i in self.stop_ids})))
        # What a call derives from its shapes, once per shape: program specs, params shardings, trace contexts.
        object.__setattr__(self, "_derived", {})

    @classmethod
    def from_config(cls, config: SamplerConfig, *, graphdef, num_samples: int, stop_ids, pad_id: int, mesh,
                    cfg=None) -> Sampler:
        """The run's sampler (`sampler.*` options, its sampling method for the mesh's platform)."""
        return cls(graphdef=graphdef, max_new_tokens=config.max_new_tokens,
                   method=SamplingMethod.from_config(config, platform(mesh)), num_samples=num_samples,
                   stop_ids=stop_ids, pad_id=pad_id, mesh=mesh, slots=config.slots or None,
                   kv_pages=config.kv_pages, page_size=config.page_size or None,
                   decode_chunk=config.decode_chunk or None, decode_layers=config.decode_layers,
                   paged_attention=config.paged_attention, shrink=None if config.shrink < 0 else config.shrink,
                   kv_cache_dtype=config.kv_cache_dtype, cfg=cfg)

    def replace(self, **changes) -> Sampler:
        return dataclasses.replace(self, **changes)

    def spec(self, batch: int, prompt_len: int, cfg, interactive: bool = False, lanes: int = 0) -> PoolSpec:
        """The static part of the program for `batch` prompts of width `prompt_len` (a stream: in `lanes` lanes)."""
        key = ("spec", batch, prompt_len, cfg, interactive, lanes)
        if key not in self._derived:
            plan, layout = plan_and_layout(self, batch, prompt_len, cfg, interactive, lanes)
            self._derived[key] = PoolSpec(plan, self.method, layout)
        return self._derived[key]

    def _context(self, cfg):
        """The context the program's kernels trace in (a mesh for splash's prefill and for the paged attention's
        kernel, which run per device), a new one per call."""
        key = ("context", cfg.attention, cfg.num_experts)
        if key not in self._derived:
            kernel = self.mesh is not None and resolve_paged_attention(self.paged_attention,
                                                                       platform(self.mesh)) == "pallas"
            self._derived[key] = functools.partial(jax.set_mesh, self.mesh) if kernel else \
                mesh_context_factory(cfg, self.mesh)
        return self._derived[key]()

    def generate(self, params, prompts: Prompts, key: jax.Array, version: int = 0) -> SampleOutput:
        """Sample the prompts' completions. `key`: one key, or [B] keys with `prompts.index` (see `Prompts`).
        `version` (the params' version) is recorded with every token."""
        prompts, cfg = self.checked(params, prompts)
        spec = self.spec(*prompts.tokens.shape, cfg)
        with self._context(cfg):  # the prefill's attention kernel may need it
            return sample(self._graphdef(params), self.placed(params), prompts, _typed(key), np.int32(version),
                          spec=spec)

    # ------------------------------------------------------------ the slot interface (jgrpo.sampling.turns)

    def start(self, params, prompts: Prompts, key: jax.Array, version: int = 0) -> turns.SlotState:
        """A pool of the prompts' rows: prefilled, every slot's first token drawn (see `jgrpo.sampling.turns`)."""
        prompts, cfg = self.checked(params, prompts)
        spec = self.spec(*prompts.tokens.shape, cfg, interactive=True)
        with self._context(cfg):
            return turns.begin(self._graphdef(params), self.placed(params), spec, prompts, _typed(key), version)

    def open_stream(self, params, *, lanes: int, batch: int, prompt_len: int) -> turns.SlotState:
        """An empty pool of `lanes` lanes of `batch` prompts of width `prompt_len`, fed with `refill`
        (`jgrpo.sampling.stream`)."""
        cfg = self._config(params)
        return stream.open_stream(self.spec(lanes * batch, prompt_len, cfg, lanes=lanes), cfg, prompt_len)

    def refill(self, params, state: turns.SlotState, lane: int, prompts: Prompts, key: jax.Array,
               order: int) -> turns.SlotState:
        """Free `lane` takes a batch of prompts (`key`: the batch's key; `prompts.index` default 0 .. B-1),
        prefilled with `params`; `order` ranks batches, oldest first. Its rows draw at the next `advance`."""
        checked, cfg = self.checked(params, prompts)
        B = checked.tokens.shape[0]
        index = jnp.arange(B, dtype=jnp.int32) if prompts.index is None else jnp.asarray(prompts.index, jnp.int32)
        keys = jnp.broadcast_to(_typed(key), (B,))
        with self._context(cfg):
            return stream.refill(self._graphdef(params), self.placed(params), state, lane,
                                 Prompts(checked.tokens, checked.mask, index), keys, order)

    def recompute(self, params, state: turns.SlotState, prompts: Prompts) -> turns.SlotState:
        """A stream's keys/values of live prompts and running rows computed again with `params` (`prompts`: the
        store's, queue-major: `jgrpo.sampling.stream.recompute`)."""
        checked, cfg = self.checked(params, prompts)
        with self._context(cfg):
            return stream.recompute(self._graphdef(params), self.placed(params), state, checked)

    def advance(self, params, state: turns.SlotState, chunks: int = 1, version: int = 0) -> turns.SlotState:
        """Decode with `params` (of `version`) up to `chunks` chunk boundaries (every `decode_chunk` steps), or
        until nothing can run."""
        with self._context(self._config(params)):
            return turns.advance(self._graphdef(params), self.placed(params), state, chunks, version)

    def append(self, params, state: turns.SlotState, slot: int, token_ids, version: int = 0) -> turns.SlotState:
        """`token_ids` after paused `slot`'s row; its next turn's first token drawn with `params` (of `version`)."""
        with self._context(self._config(params)):
            return turns.append(self._graphdef(params), self.placed(params), state, slot, token_ids, version)

    def park(self, state: turns.SlotState, slot: int) -> tuple[turns.SlotState, int]:
        """Paused `slot`'s row leaves its slot to a pending row until `resume`; returns (state, the row)."""
        return turns.park(state, slot)

    def resume(self, params, state: turns.SlotState, slot: int, row: int, token_ids,
               version: int = 0) -> turns.SlotState:
        """Parked `row`: `token_ids` after its tokens, its next turn in free `slot` (its kept context moved there)."""
        with self._context(self._config(params)):
            return turns.resume(self._graphdef(params), self.placed(params), state, slot, row, token_ids, version)

    def finish_row(self, state: turns.SlotState, row: int) -> turns.SlotState:
        """Parked `row` is complete."""
        return turns.finish_row(state, row)

    def finish(self, state: turns.SlotState, slot: int) -> turns.SlotState:
        """Paused `slot`'s row is complete; the slot takes the next pending row at the next `advance`."""
        return turns.finish(state, slot)

    def drain(self, state: turns.SlotState) -> tuple[np.ndarray, SampleOutput, turns.SlotState]:
        """(row indices, their outputs, the state): the rows completed since the last drain."""
        return turns.drain(state)

    # ------------------------------------------------------------ shared checks

    def _model(self, params):
        """(graphdef, config) of the model `params` are: the sampler's own, or its int8 form for an int8 copy
        (`sampler.weights_dtype: int8`, models/quantize.py), so one sampler runs float and int8 params alike."""
        cfg = self.cfg or model_config(self.graphdef, without_scales(params))
        projections, embeddings = quantized(params)
        if not projections:
            return self.graphdef, cfg
        key = ("int8", cfg, embeddings)
        if key not in self._derived:
            int8 = with_int8(cfg, embeddings)
            self._derived[key] = (abstract_model(int8)[0], int8)
        return self._derived[key]

    def _graphdef(self, params):
        return self._model(params)[0]

    def _config(self, params):
        return self._model(params)[1]

    def checked(self, params, prompts: Prompts) -> tuple[Prompts, Any]:
        """The prompts as device arrays once they pass the checks, and the model's config."""
        longest = _check_prompts(prompts.tokens, prompts.mask)
        prompt_len = prompts.tokens.shape[1]
        cfg = self._config(params)
        limit = getattr(cfg, "max_position_embeddings", None)
        if limit and (longest or prompt_len) + self.max_new_tokens > limit:
            raise ValueError(
                f"a prompt of {longest or prompt_len} tokens plus max_new_tokens={self.max_new_tokens} needs more "
                f"positions than the model's max_position_embeddings={limit}"
            )
        return Prompts(jnp.asarray(prompts.tokens, jnp.int32), jnp.asarray(prompts.mask, bool), prompts.index), cfg

    def placed(self, params):
        """Params in the sampling layout (resharded once if they are in another, as they are if not)."""
        if self.mesh is None:
            return params
        key = ("shardings", jax.tree.structure(params), tuple(x.shape for x in jax.tree.leaves(params)))
        if key not in self._derived:
            self._derived[key] = logical_shardings(param_logical_axes(params), self.mesh, self.rules, shapes=params)
        return jax.device_put(params, self._derived[key])

    def lower(self, params, prompts: Prompts, key) -> jax.stages.Lowered:
        """The program `generate` runs for these shapes, lowered for the mesh but not compiled or run.

        Every argument may be abstract (`jax.ShapeDtypeStruct` with a sharding; `params` in the sampling layout)
        and the mesh may be made of devices this machine does not have (a TPU topology): this is how `jgrpo.plan`
        compiles the sampler for a TPU slice. Needs `cfg`.
        """
        graphdef, cfg = self._model(params)
        spec = self.spec(*prompts.tokens.shape, cfg)
        with self._context(cfg):
            version = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated(self.mesh) if self.mesh else None)
            return sample.lower(graphdef, params, prompts, key, version, spec=spec)


def generate(graphdef, params, prompt_tokens, prompt_mask, *, key, prompt_index=None, **options) -> SampleOutput:
    """Deprecated (one release): `Sampler(graphdef, **options).generate(params, Prompts(...), key)`."""
    warnings.warn("jgrpo's generate(graphdef, params, ...) is Sampler(graphdef, ...).generate(params, prompts, key) "
                  "now (docs/architecture.md); this function goes in the next release", FutureWarning, stacklevel=2)
    return Sampler(graphdef, **options).generate(params, Prompts(prompt_tokens, prompt_mask, prompt_index), key)
