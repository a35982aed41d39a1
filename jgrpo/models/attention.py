"""Grouped-query attention over a whole sequence, with a hand-written backward pass.

Why not plain autodiff: it keeps the [B, KVH, G, T, S] scores, mask and probabilities of every layer
for the backward pass, stacked over the layer scan and zero-filled every step (the cost measured for SmolLM2:
docs/configuration.md, `model.attention`), and it grows as T^2 times the depth. Here the forward saves only
q, k, v, the output and two [B, KVH, G, T] softmax statistics; the backward recomputes the probabilities from
them, as flash attention does. Same numbers as the softmax formula (tested against autodiff of it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_FLOOR = jnp.finfo(jnp.float32).min  # not -inf: a query with nothing allowed (padding) stays finite


def _scores(q: jax.Array, k: jax.Array, allowed: jax.Array) -> jax.Array:
    """Scaled, masked scores [B, KVH, G, T, S] in float32 (G = query heads per kv head)."""
    B, T, H, Dh = q.shape
    KVH = k.shape[2]
    q = q.reshape(B, T, KVH, H // KVH, Dh)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32) * Dh**-0.5
    return jnp.where(allowed[:, None, None], scores, _FLOOR)


def _forward(q, k, v, allowed):
    scores = _scores(q, k, allowed)
    peak = jnp.max(scores, axis=-1, keepdims=True)  # [B, KVH, G, T, 1]
    unnormalised = jnp.exp(scores - peak)
    total = jnp.sum(unnormalised, axis=-1, keepdims=True)
    probs = (unnormalised / total).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(q.shape), (peak, total)


@jax.custom_vjp
def attention(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array) -> jax.Array:
    """softmax(q k^T / sqrt(Dh), over allowed slots) v. q: [B, T, H, Dh]; k, v: [B, S, KVH, Dh]; allowed: [B, T, S]."""
    return _forward(q, k, v, allowed)[0]


def _attention_fwd(q, k, v, allowed):
    out, stats = _forward(q, k, v, allowed)
    return out, (q, k, v, allowed, out, stats)


def _attention_bwd(residuals, d_out):
    q, k, v, allowed, out, (peak, total) = residuals
    B, T, H, Dh = q.shape
    KVH = k.shape[2]
    G = H // KVH
    probs = jnp.exp(_scores(q, k, allowed) - peak) / total  # [B, KVH, G, T, S] float32, recomputed
    d_out = d_out.reshape(B, T, KVH, G, Dh)
    q5 = q.reshape(B, T, KVH, G, Dh)
    dv = jnp.einsum("bkgts,btkgd->bskd", probs.astype(v.dtype), d_out)
    d_probs = jnp.einsum("btkgd,bskd->bkgts", d_out, v, preferred_element_type=jnp.float32)
    # Softmax backward: dS = P * (dP - sum_s P dP), and sum_s P dP = sum_d dO * O (one row of the output).
    row = jnp.einsum("btkgd,btkgd->bkgt", d_out.astype(jnp.float32), out.reshape(B, T, KVH, G, Dh).astype(jnp.float32))
    d_scores = probs * (d_probs - row[..., None]) * Dh**-0.5
    d_scores = jnp.where(allowed[:, None, None], d_scores, 0.0)  # the floor is a constant: no gradient
    dq = jnp.einsum("bkgts,bskd->btkgd", d_scores.astype(q.dtype), k).reshape(B, T, H, Dh)
    dk = jnp.einsum("bkgts,btkgd->bskd", d_scores.astype(k.dtype), q5)
    return dq, dk, dv, None


attention.defvjp(_attention_fwd, _attention_bwd)
