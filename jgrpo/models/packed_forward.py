"""The shared-prompt training forward over packed streams: no padding to `sampler.max_new_tokens` (#40).

`shared_prompt.forward_shared_prompts` pads every completion to N and every prompt to the run's width. Packed,
one micro-batch is two fixed blocks (`training/packing.py` plans where each token goes):
  - prompts [Kp, Wp]: each group's prompt once, a segment of its real length, positions 0, 1, ...;
  - completions [K, W]: each completion one segment of its real length, several to a row, positions
    continuing at its prompt's real length, as when it was sampled.
Every token is tagged with its group (the index of its prompt; -1 on a padding slot), and a completion token
also with its segment (1, 2, ... within its row; 0 on padding). A completion row holds one group's completions,
and `prompt_row` says which prompt row holds that group's prompt. A prompt query sees the keys of its own prompt
up to itself. A completion query sees every key of its group's prompt and the keys of its own segment up to
itself: nothing of another completion, of its group or not, nor another prompt of the prompt row.
That is exactly what each token sees in the padded forward, so the hidden states agree to float rounding
(tests/models/test_packed_forward.py), and the backward sums a prompt's key and value gradients over its
completions as there.

The completion queries of a row attend to one key sequence [its group's prompt row | the row] (the prompt row's keys
and values gathered per completion row, as the padded forward repeats a prompt's for its G rows), masked by group
and segment: Wp + W keys where a padded row has P + N, the same number at Wp = P and W = N. Used by the trainer's
log-prob passes and its update (`training/packed_passes.py`). No causal mask with segment ids expresses "its
group's prompt and its own segment" (a completion would need two segment ids), so the masks go whole to
`attention_backends.masked_attention`: dense in `custom` / `xla`, and on TPU the splash kernel with each row's mask
as data (a dynamic mask: it skips a row's key blocks that a query block sees nothing of).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jgrpo.models.attention_backends import masked_attention
from jgrpo.models.layer_stack import scan_layers
from jgrpo.models.llm import LLM, layer_output, layer_qkv, rms_norm
from jgrpo.models.quantize import compute_weights
from jgrpo.models.rope import rope_cos_sin


def rows_prompt(x, prompt_row, shards: int = 1):
    """A prompt-block array [Kp, ...] as the K completion rows see it: each row's group's prompt row, [K, ...].
    Both blocks' rows split into `shards` data shards, and a row's prompt row lies in its own shard (the plan keeps
    a group on one): gathered shard by shard (a gather batched over the shards), so no device reads another's."""
    K = prompt_row.shape[0]
    blocks = x.reshape(shards, x.shape[0] // shards, *x.shape[1:])
    local = (prompt_row % blocks.shape[1]).reshape(shards, K // shards)
    return jax.vmap(lambda block, rows: block[rows])(blocks, local).reshape(K, *x.shape[1:])


def packed_masks(prompt_group, completion_group, completion_segment, prompt_row, shards: int = 1):
    """The attention masks of the two streams: prompt queries [Kp, Wp, Wp] over their row, completion queries
    [K, W, Wp + W] over [their group's prompt row | their row]. Inputs: int32 [Kp, Wp], [K, W], [K, W], and
    `prompt_row` [K] the prompt row of each completion row's group (`rows_prompt`, `shards`)."""
    Wp, W = prompt_group.shape[1], completion_group.shape[1]
    causal_p = jnp.arange(Wp)[None, :] <= jnp.arange(Wp)[:, None]  # [query, key]
    real_p = prompt_group >= 0
    prompt_allowed = (prompt_group[:, :, None] == prompt_group[:, None, :]) & real_p[:, None, :] & causal_p[None]
    seen = rows_prompt(prompt_group, prompt_row, shards)  # [K, Wp]
    to_prompt = (completion_group[:, :, None] == seen[:, None, :]) & (seen >= 0)[:, None, :]
    causal = jnp.arange(W)[None, :] <= jnp.arange(W)[:, None]
    own = ((completion_segment[:, :, None] == completion_segment[:, None, :])
           & (completion_segment > 0)[:, None, :] & causal[None])
    return prompt_allowed, jnp.concatenate([to_prompt, own], axis=-1)


class PackedStreams(NamedTuple):
    """One packed micro-batch's two blocks: what `forward_packed` runs (`training/packing.py` plans them)."""

    prompt_tokens: jax.Array  # [Kp, Wp] int32
    prompt_group: jax.Array  # [Kp, Wp] int32: the prompt's index, -1 on padding
    prompt_positions: jax.Array  # [Kp, Wp] int32: 0, 1, ... within each prompt
    completion_tokens: jax.Array  # [K, W] int32
    completion_group: jax.Array  # [K, W] int32: the index of the completion's prompt, -1 on padding
    completion_segment: jax.Array  # [K, W] int32: 1, 2, ... per completion of a row, 0 on padding
    completion_positions: jax.Array  # [K, W] int32: its prompt's real length + j
    prompt_row: jax.Array  # [K] int32: the prompt row of each completion row's group (0 for an empty row)
    routing: tuple[jax.Array, jax.Array] | None = None  # MoE replay: experts [Kp, Wp, L, k] and [K, W, L, k]


def forward_packed(
    model: LLM,
    streams: PackedStreams,
    shards: int = 1,  # D: both blocks' rows split into D data shards, a group's prompt on its completions' shard
    *,
    router_stats: bool = False,
    group_size: int = 1,  # G: with `router_stats`, each prompt token counts G times (as in the padded rows)
    counted: jax.Array | None = None,  # [K, W] bool: the completion tokens `router_stats` counts (default: all real)
    on_rows=None,  # a sharding constraint for activations [rows, T, D]: keeps both streams' rows on their shards
):
    """Hidden states after the final norm: (prompt [Kp, Wp, D], completion [K, W, D]), and for a mixture of
    experts the experts the router picks for both streams' tokens (where `routing` replayed others too), else
    None; with `router_stats` a fourth value, each layer's `moe.RouterStats` (as `forward_shared_prompts`'). The
    numbers of `forward_shared_prompts` on the same tokens, laid out as packed."""
    cfg = model.cfg
    cdt = jnp.dtype(cfg.compute_dtype)
    (prompt_tokens, prompt_group, prompt_positions, completion_tokens, completion_group, completion_segment,
     completion_positions, prompt_row, routing) = streams
    prompt_allowed, completion_allowed = packed_masks(prompt_group, completion_group, completion_segment, prompt_row,
                                                      shards)
    prompt_real, completed = prompt_group >= 0, completion_group >= 0 if counted is None else counted
    prompt_rope = rope_cos_sin(cfg, prompt_positions)
    completion_rope = rope_cos_sin(cfg, completion_positions)

    def layer(carry, p, index, replay):
        xp, xc = carry  # [Kp, Wp, D], [K, W, D]
        replay_p, replay_c = (None, None) if replay is None else replay
        p = compute_weights(p, cdt)
        qp, kp, vp = layer_qkv(cfg, p, xp, *prompt_rope)
        qc, kc, vc = layer_qkv(cfg, p, xc, *completion_rope)
        # Each row's group's prompt before the row's own keys (the backward sums a prompt's gradients over its rows).
        keys, values = (jnp.concatenate([rows_prompt(x, prompt_row, shards), own], axis=1)
                        for x, own in ((kp, kc), (vp, vc)))
        xp, ids_p, stats_p = layer_output(cfg, p, xp, masked_attention(cfg.attention, qp, kp, vp, prompt_allowed),
                                          replay_p, prompt_real)
        xc, ids_c, stats_c = layer_output(cfg, p, xc, masked_attention(cfg.attention, qc, keys, values,
                                                                       completion_allowed), replay_c, completed)
        xp, xc = constrain(xp), constrain(xc)
        if ids_p is None:
            return (xp, xc), None
        return (xp, xc), ((ids_p, ids_c), stats_p.scaled(group_size) + stats_c)

    def constrain(x):
        return x if on_rows is None else on_rows(x)

    carry = (constrain(model.embedded(prompt_tokens)), constrain(model.embedded(completion_tokens)))
    per_layer = None if routing is None else tuple(jnp.moveaxis(r, 2, 0) for r in routing)  # [L, ...]
    (xp, xc), routed = scan_layers(cfg, layer, carry, model.layers.arrays(), per_layer, cfg.remat)
    ids, stats = (None, None) if routed is None else routed
    ids = None if ids is None else tuple(jnp.moveaxis(r, 0, 2) for r in ids)
    norm = model.final_norm[...]
    hidden = rms_norm(xp, norm, cfg.rms_norm_eps), rms_norm(xc, norm, cfg.rms_norm_eps)
    return (*hidden, ids, stats) if router_stats else (*hidden, ids)


def predecessor_hidden(prompt_hidden, completion_hidden, completion_positions_j, prompt_last):
    """The hidden state that predicts each packed completion token [K, W, D]: the previous slot of its row, or for
    a completion's first token (`completion_positions_j` == 0) its prompt's last token, at `prompt_last` [K, W]
    (an index into the flattened prompt block)."""
    previous = jnp.pad(completion_hidden, ((0, 0), (1, 0), (0, 0)))[:, :-1]
    from_prompt = prompt_hidden.reshape(-1, prompt_hidden.shape[-1])[prompt_last]
    return jnp.where((completion_positions_j == 0)[..., None], from_prompt, previous)
