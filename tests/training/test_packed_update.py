"""The update over packed micro-batches (training/packed_layout.py, `model.packing`) is the padded update: the same
loss, gradients and metrics, for every aggregation and objective, off-policy (v > 1: lp_alpha not the trainer's),
with environment tokens in a completion, over shuffled minibatches, on one device's rows and split over data
shards, and for a mixture of experts replaying the sampler's experts (LoRA: the packed run test in
test_packed_passes.py)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jgrpo.config import GRPOConfig, MeshConfig
from jgrpo.models.llm import LLM, split_model
from jgrpo.parallel.mesh import make_mesh
from jgrpo.sampling.methods import SamplingMethod
from jgrpo.training.step_options import StepOptions
from jgrpo.training.steps import StepFunctions
from tests.helpers import sampled
from tests.models.test_model_cache import MOE_CFG
from tests.models.test_shared_prompt import GQA, PROMPTS, G, N, _batch

MESHES = {"fsdp8": MeshConfig(), "data2_tensor4": MeshConfig(data=2, fsdp=1, tensor=4)}
# Each case several of the loss's switches at once (one compile of each path per case): every aggregation, the
# clip (dual too) and CISPO, GSPO's sequence ratio, token and sequence truncated / masked IS, the off-policy
# sequence mask, M2PO, the KL term (k3, k2), the overlong filter, zero-variance groups masked and not.
CASES = {
    "token_mean_clip_kl_tis_overlong": dict(aggregation="token_mean", beta=0.04, truncated_is="token", dual_clip=3.0,
                                            off_policy_ratio="current", overlong_filter=True),
    "seq_mean_cispo_mis_m2po": dict(aggregation="seq_mean_token_mean", policy_loss="cispo", masked_is="sequence",
                                    m2po_tau=0.05, beta=0.0, mask_zero_variance=False, off_policy_ratio="recentred"),
    "drgrpo_gspo_sequence_corrections": dict(aggregation="seq_mean_token_sum_norm", sequence_ratio=True,
                                             truncated_is="sequence", masked_is="token", sequence_mask_delta=0.05,
                                             beta=0.04, kl_estimator="k2", off_policy_ratio="current"),
}


def _steps(cfg, params, graphdef, grpo: GRPOConfig, mesh: str, packing: bool, **options):
    options = StepOptions(grpo=grpo, method=SamplingMethod(temperature=0.7, top_k=100), logprob_chunk=4,
                          new_tokens=N, packing=packing, on_policy=False, **options)
    return StepFunctions(graphdef=graphdef, params=params, mesh=make_mesh(MESHES[mesh]), options=options,
                         optimizer=optax.sgd(1.0))


def _off_policy_samples(steps, params, seed, routing=None, length=None):
    """The test batch with lp_alpha = the model's log-probs plus noise (a behaviour policy other than pi_k), rows
    at full length truncated, rewards with one zero-variance group; every row `length` tokens long if given."""
    prompt_tokens, prompt_mask, tokens, completion_mask = _batch(seed=seed)
    completion_mask[0, :] = True  # a full-length row in every case; row 1 a 1-token one
    completion_mask[1, 1:] = False
    if length is not None:
        completion_mask[:] = np.arange(N) < length
    samples = sampled(tokens, completion_mask, jnp.zeros(tokens.shape, jnp.float32), truncated=completion_mask[:, -1])
    # Row 4's tokens 1 and 2 (if it has them) an environment appended: in its completion, not in the loss.
    samples = samples._replace(loss_mask=samples.loss_mask.at[4, 1:3].set(False))
    if routing is not None:
        samples = samples._replace(prompt_routing=routing[0], routing=routing[1])
    rewards = jnp.asarray(np.r_[np.zeros(G), np.random.default_rng(seed).integers(0, 2, (PROMPTS - 1) * G)],
                          jnp.float32)
    batch, _ = steps.assemble(prompt_tokens, prompt_mask, samples, rewards)
    lp = np.asarray(steps.passes.pi_k(params, batch)).reshape(tokens.shape)
    noise = np.random.default_rng(seed + 1).normal(0, 0.3, tokens.shape)
    samples = samples._replace(logprobs=jnp.asarray(np.where(completion_mask, lp + noise, 0.0), jnp.float32))
    return prompt_tokens, prompt_mask, samples, rewards


def _updated(steps, params, reference, inputs, frozen=None):
    batch = steps.build(*inputs, reference=reference, current=params, frozen=frozen)
    new, _, metrics = steps.update(steps.copy_params(params), steps.init_opt_state(params), batch,
                                   shuffle_key=jax.random.key(3), frozen=frozen)
    return jax.device_get(new), metrics


def _assert_same_update(padded, packed):
    (params_a, metrics_a), (params_b, metrics_b) = padded, packed
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params_a), jax.tree.leaves(params_b), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))
    assert len(metrics_a) == len(metrics_b)
    for step_a, step_b in zip(metrics_a, metrics_b, strict=True):
        assert set(step_b) - set(step_a) == {"packing_fill", "packing_prompt_fill", "packing_micro_batches",
                                             "packing_micro_batches_max", "packing_rows_computed"}
        for key, value in step_a.items():
            np.testing.assert_allclose(step_b[key], value, rtol=1e-5, atol=1e-6, err_msg=key)
        assert 0 < step_b["packing_fill"] <= 1 and 1 <= step_b["packing_micro_batches"]
        assert 0 < step_b["packing_rows_computed"] <= 1


@pytest.mark.parametrize("case", list(CASES))
def test_the_packed_update_is_the_padded_update(case, compile_counter):
    # 2 inner steps (the second over shuffled groups, planned anew) of one minibatch, 3 micro-batches padded.
    grpo = GRPOConfig(num_generations=G, inner_steps=2, num_minibatches=1, micro_batches=3, **CASES[case])
    graphdef, params = split_model(LLM(GQA, rngs=nnx.Rngs(params=5)))
    # Packed micro-batches run only their rows in use, rounded up to a quarter, half, three quarters or all of K
    # (`model.packing_row_buckets`): a branch per bucket, each the padded numbers.
    padded = _steps(GQA, params, graphdef, grpo, "fsdp8", False)
    packed = _steps(GQA, params, graphdef, grpo, "fsdp8", True, packing_row_buckets=(0.25, 0.5, 0.75))
    assert padded.lp_k_source == "computed"
    placed = padded.copy_params(params)
    reference = jax.tree.map(lambda x: x + 0.02 * jnp.sign(x), placed)
    inputs = _off_policy_samples(padded, placed, seed=1)
    want = _updated(padded, placed, reference, inputs)
    _assert_same_update(want, _updated(packed, placed, reference, inputs))
    clipped = sum(m["clip_frac_high"] + m["clip_frac_low"] for m in want[1])
    assert clipped > 0 or case == "seq_mean_cispo_mis_m2po"  # (CISPO keeps every token's gradient)
    if case != next(iter(CASES)):
        return
    # All rows at full length (a group a packed micro-batch: 3, the overflow path), then all 1-token rows (2: a
    # micro-batch's prompt block holds 2 groups' prompts): the same numbers again, and nothing compiles again.
    for length, micro_batches in ((N, 3), (1, 2)):
        inputs = _off_policy_samples(padded, placed, seed=1, length=length)
        want = _updated(padded, placed, reference, inputs)
        compile_counter.count, compile_counter.active = 0, True
        try:
            got = _updated(packed, placed, reference, inputs)
        finally:
            compile_counter.active = False
        assert compile_counter.count == 0, f"rows of {length} tokens compiled {compile_counter.count} programs"
        _assert_same_update(want, got)
        assert [m["packing_micro_batches"] for m in got[1]] == [micro_batches] * 2
        computed = [float(m["packing_rows_computed"]) for m in got[1]]
        assert computed == [1.0] * 2 if length == N else max(computed) < 0.5  # a row a group: few rows in use


def test_the_packed_update_over_data_shards_and_minibatches():
    # Rows split over 2 data shards (a packed shard's groups are not the padded shard's), 3 minibatches of one
    # group each.
    grpo = GRPOConfig(num_generations=G, num_minibatches=3, micro_batches=1, beta=0.04, masked_is="token")
    graphdef, params = split_model(LLM(GQA, rngs=nnx.Rngs(params=5)))
    padded, packed = (_steps(GQA, params, graphdef, grpo, "data2_tensor4", p) for p in (False, True))
    placed = padded.copy_params(params)
    inputs = _off_policy_samples(padded, placed, seed=2)
    _assert_same_update(_updated(padded, placed, placed, inputs), _updated(packed, placed, placed, inputs))


def test_a_mixture_of_experts_packed_update_replays_as_padded():
    # Routing replay, its metrics (routing mismatch counted over the same positions, expert loads) and the router's
    # load-balance and z losses in the loss (one packed micro-batch: the padded micro-batch's tokens).
    cfg = dataclasses.replace(MOE_CFG, vocab_size=128)
    grpo = GRPOConfig(num_generations=G, beta=0.0, inner_steps=2)
    graphdef, params = split_model(LLM(cfg, rngs=nnx.Rngs(params=5)))
    rng = np.random.default_rng(4)
    R, P = PROMPTS * G, 7
    experts = rng.integers(0, cfg.num_experts, (R, P + N, cfg.num_layers, 2)).astype(np.uint8)
    experts[..., 1] = (experts[..., 0] + 1 + rng.integers(0, cfg.num_experts - 1, experts.shape[:-1])) % 8
    experts[:, :P] = experts[::G, :P].repeat(G, axis=0)  # the sampler ran each prompt once
    routing = (jnp.asarray(experts[:, :P]), jnp.asarray(experts[:, P:]))
    padded, packed = (_steps(cfg, params, graphdef, grpo, "fsdp8", p, routing_replay=True,
                             router_loss_coefs=(0.01, 0.001)) for p in (False, True))
    placed = padded.copy_params(params)
    inputs = _off_policy_samples(padded, placed, seed=3, routing=routing)
    want = _updated(padded, placed, placed, inputs)
    assert want[1][0]["routing_count"] > 0 and want[1][0]["router_aux_loss"] > 0
    _assert_same_update(want, _updated(packed, placed, placed, inputs))
