"""The model as the trainer's programs run it, whatever the batch's layout: which graph a params pytree merges into,
the per-token log-probs of the hidden states (the vocabulary sharded as the weights), the placement of the batch's
rows, and the mesh context its programs are traced in. The layouts (`padded_layout`, `packed_layout`) run their
forwards with it; a forward's result is a `Forward`, in the padded [rows, N] layout whatever the batch's.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
from jax.sharding import Mesh, NamedSharding

from jgrpo.models.attention_backends import mesh_context_factory
from jgrpo.models.llm import abstract_model, merge_model
from jgrpo.models.lora import is_adapter, without_lora
from jgrpo.parallel.mesh import Rules, logical_to_spec, row_sharding
from jgrpo.rl.logprobs import token_logprobs
from jgrpo.training.step_options import StepOptions


class Forward(NamedTuple):
    """One micro-batch's forward: per-token [r, N] values of its rows' completion tokens."""

    lp: jax.Array  # log-probs under the sampling method's distribution (truncated like the sampler's)
    entropy: jax.Array  # that distribution's entropy
    lp_kl: jax.Array | None  # the untruncated tempered log-probs for the KL term (a truncating method and beta > 0)
    routing: dict  # a mixture of experts' router losses and routing metrics (`rl.routing_replay`); {} if dense


class InContext:
    """A jitted function called and lowered inside `context()` (where its tracing must happen)."""

    def __init__(self, jitted, context):
        self.jitted, self.context = jitted, context

    def __call__(self, *args, **kwargs):
        with self.context():
            return self.jitted(*args, **kwargs)

    def lower(self, *args, **kwargs):
        with self.context():
            return self.jitted.lower(*args, **kwargs)


class StepModel:
    """The trainer's model of one run (`cfg` its config, `graphdef` its graph) on `mesh`."""

    def __init__(self, graphdef, cfg, mesh: Mesh, rules: Rules, options: StepOptions):
        self.graphdef, self.cfg, self.mesh, self.rules = graphdef, cfg, mesh, rules
        self.method, self.chunk = options.method, options.logprob_chunk
        # The reference of a LoRA run is the base alone: the same model without adapter leaves.
        self.base_graphdef = abstract_model(without_lora(cfg))[0] if cfg.lora_rank else None
        # Programs that run the model are traced in the mesh context where the attention kernel needs it.
        self.context = mesh_context_factory(cfg, mesh)

    def jit(self, fn, **kwargs) -> InContext:
        """`jax.jit(fn, **kwargs)`, called and lowered in the model's mesh context."""
        return InContext(jax.jit(fn, **kwargs), self.context)

    def of(self, params):
        """The model of `params` (a LoRA run's reference, without adapters, is the base model)."""
        adapters = any(is_adapter(name) for name in params["layers"])
        return merge_model(self.graphdef if adapters or self.base_graphdef is None else self.base_graphdef, params)

    def rows(self, x: jax.Array, row_axis: int = 1) -> jax.Array:
        """Constrain `x`'s rows (axis `row_axis`; 1 in the batch's [C, r, ...]) to the data-parallel axes (where they
        divide)."""
        return jax.lax.with_sharding_constraint(x, row_sharding(self.mesh, self.rules, x.shape, row_axis=row_axis))

    def token_logprobs(self, model, hidden, targets, kind: str, with_kl: bool = False):
        """`rl.logprobs.token_logprobs` of `targets` [r, T] from the `hidden` states predicting them [r, T, D], the
        vocabulary sharded as the weights: a tuple (lp, entropy[, untruncated lp]).

        kind "sampled": under the sampling method's distribution (truncated like the sampler's), plus, `with_kl`
        and a truncating method, the untruncated tempered log-probs for the KL term.
        kind "kl": the untruncated tempered log-probs, what the reference contributes to the KL.
        """
        tempered = self.method.tempered_logprobs
        process = tempered if kind == "kl" else self.method.process_logits
        untruncated = tempered if kind == "sampled" and with_kl and self.method.truncates else None
        unembedding = model.unembedding()
        # Log-probs shard the vocabulary over the axes that shard the weights: rows over the data axis only,
        # vocabulary over fsdp and tensor. Constraints where a dimension does not divide are dropped by
        # logical_to_spec (then XLA chooses, as without them).
        rules = {"batch": "data", "length": None, "embed": None, "vocab": ("fsdp", "tensor")}
        shapes = (unembedding.shape, (hidden.shape[0], self.chunk, unembedding.shape[1]))
        vocab_parallel = tuple(NamedSharding(self.mesh, logical_to_spec(names, rules, shape, self.mesh))
                               for names, shape in zip((("embed", "vocab"), ("batch", "length", "vocab")), shapes,
                                                       strict=True))
        return token_logprobs(hidden, unembedding, targets, chunk=self.chunk, process_logits=process,
                              untruncated=untruncated, compute_dtype=model.cfg.compute_dtype,
                              vocab_parallel=vocab_parallel)


def forward_of(logprobs: tuple, routing: dict) -> Forward:
    """A `Forward` of `StepModel.token_logprobs`' tuple and the forward's router metrics."""
    lp, entropy, *untruncated = logprobs
    return Forward(lp, entropy, untruncated[0] if untruncated else None, routing)
