"""Routing replay (R3) for mixture-of-experts policies: the trainer's forwards use the experts the sampler used.

A top-k router is a discontinuous function of its input: the sampler's forward (a decode step, one token against a
cache) and the trainer's (a whole sequence at once, other matmul shapes) round differently, and where two experts'
probabilities are within that rounding of each other the token goes to another expert. The trainer then scores a
different network than the one that sampled, and the importance ratio pi_theta / alpha measures routing noise,
not a policy change. The sampler records the experts of every position it runs (`SampleOutput.routing`,
`prompt_routing`); with `model.routing_replay: rollout` every trainer forward (the reference's log-probs, pi_k's,
the update) sends each token to those experts, with gates from the trainer's router at those ids, so gradients
still reach the router (`models.moe.route`). docs/algorithm.md §16 says what this means off-policy.

Here: the record laid out as the trainer's input sequence, and what a trainer forward reports about its router:
    router_aux_loss    the load-balance loss, router_z_loss the z loss (`models.moe.router_losses`), which the update
                       adds to its loss with `model.router_*_loss_coef` > 0
    routing_mismatch   share of (position, layer) top-k sets the trainer's router would choose differently from the
                       record (with replay: where replay overrode it), over the positions the sampler ran
    expert_load_max    the most loaded expert's tokens over the mean, in the worst layer (1 = even load), of the
                       experts that ran in the update's forward (over its real tokens: the router's own statistics)
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jgrpo.models.moe import RouterStats, router_losses


def sequence_routing(prompt_routing, routing, prompt_width: int):
    """[R, P + N - 1, L, k] (the record's dtype): the recorded experts of the trainer's input positions [prompt |
    completion but its last token]. `prompt_routing` [R, Ps, L, k] is left-padded to the sampler's prompt width
    Ps, which may differ from the trainer's `prompt_width` P (another batch widened the run's prompts since): the
    real tokens are the last ones either way, so the record is right-aligned to P."""
    return jnp.concatenate([right_aligned(prompt_routing, prompt_width), routing[:, :-1]], axis=1)


def right_aligned(prompt_records, width: int):
    """Per-row prompt records [R, Ps, ...] (numpy or jax) of left-padded prompts as [R, width, ...]: zeros added at
    the front, or front columns dropped; the real tokens are the last ones either way."""
    Ps = prompt_records.shape[1]
    if Ps >= width:
        return prompt_records[:, Ps - width:]
    padding = [(0, 0), (width - Ps, 0)] + [(0, 0)] * (prompt_records.ndim - 2)
    return np.pad(prompt_records, padding) if isinstance(prompt_records, np.ndarray) else jnp.pad(prompt_records,
                                                                                                  padding)


def sampler_ran(input_mask, last_target_mask, prompt_width: int):
    """[r, T] bool: the input positions the sampler's forward ran (and recorded): every real prompt token and every
    completion token but a row's last (drawn and never fed). `last_target_mask` [r]: the row's last completion
    slot (N - 1) holds a token, so the last input position was fed."""
    T = input_mask.shape[1]
    next_real = jnp.concatenate([input_mask[:, 1:], last_target_mask[:, None]], axis=1)
    return input_mask & ((jnp.arange(T) < prompt_width) | next_real)


def routing_metrics(chosen, recorded, ran) -> dict:
    """Sums for the update's metrics (`rl.diagnostics.finalize_metrics`): `chosen` [r, T, L, k] the trainer router's
    top k, `recorded` [r, T, L, k] the sampler's, `ran` [r, T] the positions both cover."""
    differs = jnp.any(jnp.sort(chosen, axis=-1) != jnp.sort(recorded, axis=-1), axis=-1)  # [r, T, L]
    weight = jnp.broadcast_to(ran.astype(jnp.float32)[..., None], differs.shape)
    return {"routing_mismatch_count": jnp.sum(differs * weight), "routing_count": jnp.sum(weight)}


def forward_metrics(router: RouterStats, chosen, recorded, ran) -> dict:
    """A mixture of experts' trainer forward: its router losses (differentiable), the tokens each expert of each
    layer ran (`expert_tokens` [L, E], the replayed experts under replay: the router's own counts), and with a
    routing record (`recorded` [r, T, L, k], None without one) the routing metrics over the positions `ran`."""
    metrics = dict(zip(("router_aux_loss", "router_z_loss"), router_losses(router), strict=True))
    metrics["expert_tokens"] = router.assignments
    if recorded is not None:
        metrics.update(routing_metrics(chosen, recorded, ran))
    return metrics
