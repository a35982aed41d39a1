"""Splitting an optimiser step into micro-batches, or sharding it over the 8-device mesh, changes nothing.

The policy is a real (tiny) one: lp = token_logprobs(hidden, W, targets) with the unembedding W as the
parameter, so gradients are those of a shared parameter summed over rows, as in training. The step's
normalisers are computed once from the full batch; each micro-batch is a slice of rows of every input.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jgrpo.config import GRPOConfig, MeshConfig
from jgrpo.parallel.mesh import TRAIN_RULES, make_mesh, row_sharding
from jgrpo.rl.advantages import group_advantages
from jgrpo.rl.corrections import m2po_drop
from jgrpo.rl.diagnostics import combine_metrics, finalize_metrics
from jgrpo.rl.logprobs import token_logprobs
from jgrpo.rl.loss_records import LossExtras, LossInputs
from jgrpo.rl.objectives import grpo_loss, step_normaliser

N, T, D, V, G = 16, 6, 8, 11, 4
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
VARIANTS = {
    "behaviour+dual+k3": dict(off_policy_ratio="behaviour", dual_clip=1.5, beta=0.1),
    "recentred+gspo+k2": dict(off_policy_ratio="recentred", sequence_ratio=True, beta=0.05, kl_estimator="k2"),
    "current+dual+tis_token": dict(off_policy_ratio="current", dual_clip=1.5, truncated_is="token", beta=0.1),
    "current+gspo+tis_seq": dict(off_policy_ratio="current", sequence_ratio=True, truncated_is="sequence"),
    "current_i1+k1": dict(off_policy_ratio="current", beta=0.02, kl_estimator="k1"),
    "cispo+mis_token+m2po": dict(policy_loss="cispo", cispo_eps_high=0.1, masked_is="token", masked_is_low=0.8,
                                 masked_is_high=1.25, m2po_tau=0.02, beta=0.05),
    "current+mis_seq+tis+seqmask": dict(off_policy_ratio="current", masked_is="sequence", masked_is_low=0.9,
                                        masked_is_high=1.1, truncated_is="token", sequence_mask_delta=0.0),
}


def _logprobs(w, batch):
    return token_logprobs(batch["hidden"], w, batch["targets"], chunk=4)


@functools.cache
def _problem():
    keys = jax.random.split(jax.random.PRNGKey(42), 8)
    w = jax.random.normal(keys[0], (D, V))
    hidden = jax.random.normal(keys[1], (N, T, D))
    targets = jax.random.randint(keys[2], (N, T), 0, V)
    lengths = jax.random.randint(keys[3], (N,), 1, T + 1)
    mask = jnp.arange(T)[None, :] < lengths[:, None]  # [N, T]
    rewards = jnp.array([1.0, 0, 0, 1, 1, 1, 1, 1, 0, 0.5, 1, 1, 0, 0, 1, 0])  # group 1 has zero variance
    batch = {"hidden": hidden, "targets": targets, "mask": mask}
    # Behaviour, start-of-iteration and reference policies: perturbed unembeddings (no gradient).
    for name, key, scale in (("lp_alpha", keys[4], 0.3), ("lp_k", keys[5], 0.15), ("lp_ref", keys[6], 0.2)):
        batch[name] = _logprobs(w + scale * jax.random.normal(key, w.shape), batch)[0]
    return w, batch, rewards


def _loss_fn(w, batch, adv, norm, cfg, use_lp_k):
    lp, entropy = _logprobs(w, batch)
    inputs = LossInputs(lp, batch["lp_alpha"], batch["lp_k"] if use_lp_k else None, adv, batch["mask"])
    extras = LossExtras(lp_ref=batch["lp_ref"], m2po_drop=batch.get("m2po_drop"), entropy=entropy,
                        lp_behaviour_trainer=batch["lp_alpha"] + 0.01, staleness=2)
    return grpo_loss(inputs, norm, cfg, extras)


def _setup(variant, aggregation):
    w, batch, rewards = _problem()
    cfg = GRPOConfig(num_generations=G, clip_eps_low=0.1, clip_eps_high=0.15, aggregation=aggregation,
                     **VARIANTS[variant])
    adv = group_advantages(rewards, cfg)
    norm = step_normaliser(batch["mask"], adv.in_loss, cfg, max_new_tokens=T + 2)
    if cfg.m2po_tau is not None:  # decided once over the whole batch, then sliced like every other input
        batch = {**batch, "m2po_drop": m2po_drop(batch["lp_k"], batch["lp_alpha"],
                                                 batch["mask"] & adv.in_loss[:, None], cfg.m2po_tau)}
    # current mode without truncated IS runs as inner step 1 (lp_k = sg(lp)); with it, as a later update
    use_lp_k = cfg.off_policy_ratio != "current" or cfg.truncated_is != "none"
    grad_fn = jax.jit(jax.value_and_grad(functools.partial(_loss_fn, cfg=cfg, use_lp_k=use_lp_k), has_aux=True))
    return w, batch, adv, norm, grad_fn


def _close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_micro_batches_sum_to_the_full_step(variant, aggregation):
    w, batch, adv, norm, grad_fn = _setup(variant, aggregation)
    (loss, metrics), grad = grad_fn(w, batch, adv, norm)
    full = finalize_metrics(metrics)
    if not variant.startswith("current_i1"):  # (at i = 1 the current ratio is exactly 1: nothing is clipped)
        assert full["clip_frac_low"] + full["clip_frac_high"] > 0  # the clip is active somewhere: a real test
    for dropped in ("mis_drop_frac", "m2po_drop_frac", "sequence_mask_frac"):  # so are the masks
        assert full.get(dropped, 1.0) > 0, dropped
    for micro in (2, 4):
        size = N // micro
        total_loss, total_grad, acc = 0.0, jnp.zeros_like(w), None
        for i in range(micro):
            rows = slice(i * size, (i + 1) * size)
            part = jax.tree.map(lambda x, rows=rows: x[rows], (batch, adv))
            (part_loss, m), g = grad_fn(w, *part, norm)
            total_loss, total_grad = total_loss + part_loss, total_grad + g
            acc = m if acc is None else combine_metrics(acc, m)
        _close(total_loss, loss)
        _close(total_grad, grad)
        for key, value in finalize_metrics(acc).items():
            np.testing.assert_allclose(value, full[key], rtol=1e-6, atol=1e-7, err_msg=f"{key} with {micro} micro")


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("variant", ["current+dual+tis_token", "cispo+mis_token+m2po"])
def test_sharded_over_the_mesh_equals_unsharded(aggregation, variant):
    w, batch, adv, norm, grad_fn = _setup(variant, aggregation)
    (loss, metrics), grad = grad_fn(w, batch, adv, norm)
    mesh = make_mesh(MeshConfig(data=2, fsdp=4, tensor=1))
    assert mesh.devices.size == 8
    rows_of = lambda x: row_sharding(mesh, TRAIN_RULES, x.shape)  # rows over (data, fsdp), the rest replicated
    replicated = NamedSharding(mesh, PartitionSpec())
    shardings = (replicated, jax.tree.map(rows_of, batch), jax.tree.map(rows_of, adv),
                 jax.tree.map(lambda _: replicated, norm))
    cfg = GRPOConfig(num_generations=G, clip_eps_low=0.1, clip_eps_high=0.15, aggregation=aggregation,
                     **VARIANTS[variant])
    sharded_fn = jax.jit(jax.value_and_grad(functools.partial(_loss_fn, cfg=cfg, use_lp_k=True), has_aux=True),
                         in_shardings=shardings)
    args = jax.device_put((w, batch, adv, norm), shardings)
    assert len(args[1]["hidden"].sharding.device_set) == 8
    if "m2po_drop" in batch:  # M2PO's whole-batch mask, computed on the sharded batch, is the same mask
        b = args[1]
        in_loss_tokens = b["mask"] & args[2].in_loss[:, None]
        sharded_drop = jax.jit(m2po_drop, static_argnums=3)(b["lp_k"], b["lp_alpha"], in_loss_tokens, cfg.m2po_tau)
        np.testing.assert_array_equal(sharded_drop, batch["m2po_drop"])
    (s_loss, s_metrics), s_grad = sharded_fn(*args)
    _close(s_loss, loss)
    _close(s_grad, grad)
    full, sharded = finalize_metrics(metrics), finalize_metrics(s_metrics)
    for key in full:
        np.testing.assert_allclose(sharded[key], full[key], rtol=1e-6, atol=1e-7, err_msg=key)
