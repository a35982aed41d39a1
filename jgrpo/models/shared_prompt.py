"""The training forward pass with each prompt computed once for its group of G completions.

A GRPO batch holds G completions of every prompt, and the trainer scores [prompt | completion] rows.
Run as plain rows, the model computes every prompt's tokens G times over, forward and backward, for the
same hidden states. Here each layer runs two streams instead: the Bp distinct prompts [Bp, P] and the
R = Bp * G completions [R, N]. Prompt queries attend within their prompt (causal, as before); completion
queries attend to their group's prompt keys and values (repeated G times, so the backward sums their G
gradients) followed by the completion's own keys (causal). Every token sees exactly what it sees in the
full [R, P + N] forward, so the numbers agree to float rounding (tested), and the prompt's share of the
matmul work drops by a factor G: with SmolLM2 at 4 x 4 rows of 64 + 128 tokens, a quarter of the step.

On a mesh the rows stay sharded over the data axes; a group is cheapest when its G rows live on one device
(rows per device a multiple of G), otherwise XLA moves the prompt's keys and values between devices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jgrpo.models.attention_backends import causal_attention
from jgrpo.models.layer_stack import scan_layers
from jgrpo.models.llm import LLM, layer_output, layer_qkv, position_ids_from_mask, rms_norm
from jgrpo.models.quantize import compute_weights
from jgrpo.models.rope import rope_cos_sin


def forward_shared_prompts(
    model: LLM,
    prompt_tokens: jax.Array,  # [Bp, P] int32, left-padded
    prompt_mask: jax.Array,  # [Bp, P] bool
    completion_tokens: jax.Array,  # [R, N] int32, R = Bp * G; rows b*G ... b*G + G-1 continue prompt b
    completion_mask: jax.Array,  # [R, N] bool
    completion_positions: jax.Array,  # [R, N] int32: the real prompt length of the row's prompt + j
    routing: tuple[jax.Array, jax.Array] | None = None,  # MoE replay: experts [Bp, P, L, k] and [R, N, L, k]
    router_stats: bool = False,
):
    """Hidden states after the final norm: (prompt [Bp, P, D], completion [R, N, D]), and for a mixture of
    experts the experts the router picks for both streams' tokens ([Bp, P, L, k], [R, N, L, k]; where `routing`
    replayed others too), else None. `router_stats`: a fourth value, each layer's `moe.RouterStats` over the real
    tokens, each prompt token counted G times (as in the full rows).

    The same numbers as `model.routed(concat(repeat(prompt, G), completion), ...)` sliced into the two parts.
    """
    cfg = model.cfg
    cdt = jnp.dtype(cfg.compute_dtype)
    Bp, R = prompt_tokens.shape[0], completion_tokens.shape[0]
    if R % Bp:
        raise ValueError(f"{R} completion rows are not a whole number of groups of the {Bp} prompts")
    G = R // Bp
    prompt_mask = prompt_mask.astype(bool)
    # Completion queries are the last N of their P + N key slots: the whole real prompt, then causal.
    completion_valid = jnp.concatenate([jnp.repeat(prompt_mask, G, axis=0), completion_mask.astype(bool)], axis=1)
    prompt_rope = rope_cos_sin(cfg, position_ids_from_mask(prompt_mask))
    completion_rope = rope_cos_sin(cfg, completion_positions)

    def layer(carry, p, index, replay):
        xp, xc = carry  # [Bp, P, D], [R, N, D]
        replay_p, replay_c = (None, None) if replay is None else replay
        p = compute_weights(p, cdt)
        qp, kp, vp = layer_qkv(cfg, p, xp, *prompt_rope)
        qc, kc, vc = layer_qkv(cfg, p, xc, *completion_rope)
        keys = jnp.concatenate([jnp.repeat(kp, G, axis=0), kc], axis=1)  # [R, P + N, KVH, Dh]
        values = jnp.concatenate([jnp.repeat(vp, G, axis=0), vc], axis=1)
        xp, ids_p, stats_p = layer_output(cfg, p, xp, causal_attention(cfg.attention, qp, kp, vp, prompt_mask),
                                          replay_p, prompt_mask)
        xc, ids_c, stats_c = layer_output(cfg, p, xc, causal_attention(cfg.attention, qc, keys, values,
                                                                       completion_valid), replay_c, completion_mask)
        if ids_p is None:
            return (xp, xc), None
        return (xp, xc), ((ids_p, ids_c), stats_p.scaled(G) + stats_c)

    carry = (model.embedded(prompt_tokens), model.embedded(completion_tokens))
    per_layer = None if routing is None else tuple(jnp.moveaxis(r, 2, 0) for r in routing)  # [L, ...]
    (xp, xc), routed = scan_layers(cfg, layer, carry, model.layers.arrays(), per_layer, cfg.remat)
    ids, stats = (None, None) if routed is None else routed
    ids = None if ids is None else tuple(jnp.moveaxis(r, 0, 2) for r in ids)
    norm = model.final_norm[...]
    hidden = rms_norm(xp, norm, cfg.rms_norm_eps), rms_norm(xc, norm, cfg.rms_norm_eps)
    return (*hidden, ids, stats) if router_stats else (*hidden, ids)
