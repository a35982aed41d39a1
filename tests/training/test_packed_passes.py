"""The log-prob passes over packed micro-batches (training/packed_layout.py, `model.packing`) give the padded
passes' numbers at every real completion token: pi_k's and the reference's, on one device's rows and split over
data shards, for a mixture of experts replaying the sampler's experts too; `build` takes the packed path."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jgrpo.config import GRPOConfig, MeshConfig
from jgrpo.models.llm import LLM, split_model
from jgrpo.parallel.mesh import make_mesh
from jgrpo.sampling.methods import SamplingMethod
from jgrpo.training.packed_layout import PackedLayout
from jgrpo.training.packed_passes import data_shards, plan_batch
from jgrpo.training.step_options import StepOptions
from jgrpo.training.steps import StepFunctions
from tests.helpers import sampled
from tests.models.test_model_cache import MOE_CFG
from tests.models.test_shared_prompt import GQA, PROMPTS, G, N, _batch

MESHES = {"fsdp8": MeshConfig(), "data2_tensor4": MeshConfig(data=2, fsdp=1, tensor=4)}


def _steps(cfg, params, graphdef, mesh, packing, micro_batches, replay=False, row_buckets=()):
    grpo = GRPOConfig(num_generations=G, beta=0.04, micro_batches=micro_batches)
    options = StepOptions(grpo=grpo, method=SamplingMethod(temperature=0.7, top_k=100), logprob_chunk=4, new_tokens=N,
                          packing=packing, routing_replay=replay, packing_row_buckets=row_buckets)
    return StepFunctions(graphdef=graphdef, params=params, mesh=make_mesh(MESHES[mesh]), options=options,
                         optimizer=optax.sgd(1.0))


# (One device's rows at micro_batches 1, and data shards, are the update's tests: its packed passes feed them.)
@pytest.mark.parametrize(("mesh", "micro_batches"), [("fsdp8", 3)])
def test_packed_passes_give_the_padded_log_probs(mesh, micro_batches):
    graphdef, params = split_model(LLM(GQA, rngs=nnx.Rngs(params=5)))
    prompt_tokens, prompt_mask, tokens, completion_mask = _batch(seed=1)
    samples = sampled(tokens, completion_mask, jnp.zeros(tokens.shape, jnp.float32))
    rewards = jnp.asarray(np.random.default_rng(2).integers(0, 2, PROMPTS * G), jnp.float32)
    padded = _steps(GQA, params, graphdef, mesh, False, micro_batches)
    packed = _steps(GQA, params, graphdef, mesh, True, micro_batches, row_buckets=(0.5,))  # half the rows or all
    placed = padded.copy_params(params)
    batch, _ = padded.assemble(prompt_tokens, prompt_mask, samples, rewards)
    plan = packed.layout.plan_passes(prompt_tokens, prompt_mask, samples, batch)
    assert 0 < int(plan.rows_used[:int(plan.count)].min()) <= plan.tokens.shape[1] // 2  # a half-size branch runs
    shards = data_shards(packed.model.mesh, packed.model.rules, packed.assembly.chunks, PROMPTS * G)
    assert shards == (2 if mesh == "data2_tensor4" else 1)  # 12 rows split over data (2), not over fsdp (8)
    # The packed micro-batches used, of a buffer of one per group. On one shard 1 for the 12 rows (the 3 groups in
    # one), 3 for 4-row micro-batches (a group's 4 completions fill one); on two, a shard's half-size block can
    # need more micro-batches than the padded pass (whole groups per shard): the same numbers either way.
    assert 1 <= int(plan.count) <= plan.tokens.shape[0] == PROMPTS
    if shards == 1:
        assert int(plan.count) == (1 if micro_batches == 1 else 3)
    real = np.asarray(completion_mask).reshape(batch.targets.shape)
    for padded_pass, packed_pass in ((padded.passes.pi_k, packed.passes.pi_k),
                                     (padded.passes.reference, packed.passes.reference)):
        want = np.asarray(padded_pass(placed, batch))
        got = np.asarray(packed_pass(placed, batch, plan=plan))
        assert got.shape == want.shape
        np.testing.assert_allclose(got[real], want[real], atol=2e-5, rtol=0)
        assert (got[~real] == 0).all()
    # build: the reference's log-probs from the packed pass, as the padded build's.
    built = [s.build(prompt_tokens, prompt_mask, samples, rewards, reference=placed, current=placed)
             for s in (padded, packed)]
    np.testing.assert_allclose(np.asarray(built[1].lp_ref)[real], np.asarray(built[0].lp_ref)[real], atol=2e-5)


def test_a_mixture_of_experts_replays_the_sampled_experts_packed_as_padded():
    cfg = dataclasses.replace(MOE_CFG, vocab_size=128)
    graphdef, params = split_model(LLM(cfg, rngs=nnx.Rngs(params=5)))
    prompt_tokens, prompt_mask, tokens, completion_mask = _batch(seed=1)
    rng = np.random.default_rng(4)
    R, P = PROMPTS * G, prompt_tokens.shape[1]
    experts = rng.integers(0, cfg.num_experts, (R, P + N, cfg.num_layers, 2)).astype(np.uint8)
    experts[..., 1] = (experts[..., 0] + 1 + rng.integers(0, cfg.num_experts - 1, experts.shape[:-1])) % 8  # 2 distinct
    experts[:, :P] = experts[::G, :P].repeat(G, axis=0)  # the sampler ran each prompt once
    samples = sampled(tokens, completion_mask, jnp.zeros(tokens.shape, jnp.float32))._replace(
        prompt_routing=jnp.asarray(experts[:, :P]), routing=jnp.asarray(experts[:, P:]))
    rewards = jnp.ones(R, jnp.float32)
    padded, packed = (_steps(cfg, params, graphdef, "fsdp8", p, 1, replay=True) for p in (False, True))
    placed = padded.copy_params(params)
    batch, _ = padded.assemble(prompt_tokens, prompt_mask, samples, rewards)
    real = np.asarray(completion_mask).reshape(batch.targets.shape)
    want = np.asarray(padded.passes.pi_k(placed, batch))
    got = np.asarray(packed.passes.pi_k(placed, batch,
                                        plan=packed.layout.plan_passes(prompt_tokens, prompt_mask, samples, batch)))
    np.testing.assert_allclose(got[real], want[real], atol=2e-5, rtol=0)
    # The replay matters: without it the same model gives other log-probs (the random experts are not its own).
    unreplayed = _steps(cfg, params, graphdef, "fsdp8", False, 1, replay=False)
    assert np.nanmax(np.abs(np.asarray(unreplayed.passes.pi_k(placed, batch))[real] - want[real])) > 1e-3


def test_a_packed_run_trains_as_the_padded_one_and_never_recompiles(tmp_path, monkeypatch, compile_counter):
    # The tiny run with LoRA adapters, the reference's pass (beta > 0: the base alone), pi_k's (masked IS over 2
    # minibatches) and the update packed: the first iteration's loss, KL, masked-IS drops and gradient norm are the
    # padded run's (same keys, same params). Its second batch (other lengths: the plan's arrays and micro-batch
    # count are traced arguments) compiles nothing (of 3 iterations: the last one's save compiles its checksums).
    import jgrpo.training.packed_passes as passes_module
    from jgrpo.training.trainer import Trainer
    from tests.helpers import QUIET, tiny_config

    plans = []
    monkeypatch.setattr(passes_module, "plan_batch", lambda *a, **k: plans.append(1) or plan_batch(*a, **k))
    records = {}
    for packing in (False, True):
        trainer = Trainer(tiny_config(tmp_path / str(packing), *QUIET, f"model.packing={packing}",
                                      "grpo.masked_is=token", "grpo.num_minibatches=2", "run.iterations=3",
                                      "model.packing_row_buckets=[0.5]",
                                      "model.lora.rank=4", "model.lora.alpha=8", "optim.learning_rate=1e-2"))
        try:
            assert trainer.steps.lp_k_source == "computed"
            assert isinstance(trainer.steps.layout, PackedLayout) == packing
            records[packing] = trainer.train_iteration()
            if packing:
                compile_counter.count, compile_counter.active = 0, True
                trainer.train_iteration()
                compile_counter.active = False
                assert compile_counter.count == 0, f"iteration 2 compiled {compile_counter.count} programs"
        finally:
            compile_counter.active = False
            trainer.close()
    # The packed run's two batches, each planned once for both passes and once per minibatch for the update.
    assert len(plans) == 2 * (1 + 2)
    assert 0 < records[True]["packing/fill"] <= 1 and records[True]["packing/micro_batches_max"] >= 1
    for key in ("loss/loss", "loss/kl_loss", "kl/mean", "loss/mis_drop_frac", "loss/grad_norm", "loss/ratio_max"):
        np.testing.assert_allclose(records[True][key], records[False][key], rtol=1e-4, atol=1e-6, err_msg=key)
    assert records[False]["kl/mean"] != 0


@pytest.mark.parametrize("overrides,message", [
    (["model.packing=true", "model.share_prompts=false"], "model.packing=True is not allowed: it needs "
                                                          "model.share_prompts=true"),
    (["model.packing=true", "model.packing_width=6"], "model.packing_width=6 is not allowed: >= the completion "
                                                      "width 8"),
    (["model.packing_row_buckets=[0.5,1]"], "model.packing_row_buckets=\\[0.5, 1.0\\] is not allowed: fractions "
                                            "strictly between 0 and 1"),
])
def test_packing_settings_that_cannot_work_are_config_errors(overrides, message):
    from jgrpo.config import ConfigError
    from tests.helpers import tiny_config

    with pytest.raises(ConfigError, match=message):
        tiny_config(None, *overrides)


def test_rows_in_use_and_their_buckets_by_hand():
    # 2 micro-batches of K = 8 rows in 2 data shards of 4: micro-batch 0 uses shard 0's first row and shard 1's
    # first 3 (3 a shard, the most of any), micro-batch 1 none. With buckets of a quarter and a half of 4 rows (1,
    # 2) and all (4), 3 rows run as 4; a cut keeps each shard's first k rows and leaves the prompt block whole.
    from jgrpo.training.packed_passes import PackedBatch, _rows_used, first_rows, row_buckets
    from jgrpo.training.packing import PackedSizes

    row = np.full((2, 8, 5), -1)
    row[0, 0, :2] = 0
    row[0, 4:7, 0] = 1
    sizes = PackedSizes(rows=8, width=5, prompt_rows=2, prompt_width=3, micro_batches=2, shards=2)
    np.testing.assert_array_equal(_rows_used(row, sizes), [3, 0])
    assert row_buckets(4, (0.25, 0.5)) == [1, 2, 4] and row_buckets(4, ()) == [4] and row_buckets(8, (0.9,)) == [8]
    fields = dict(tokens=np.arange(8 * 5).reshape(8, 5), prompt_tokens=np.zeros((2, 3)))
    micro = PackedBatch(**{f: None for f in PackedBatch._fields} | {k: jnp.asarray(v) for k, v in fields.items()})
    cut = first_rows(micro, 2, shards=2)
    np.testing.assert_array_equal(cut.tokens, np.arange(40).reshape(8, 5)[[0, 1, 4, 5]])
    assert cut.prompt_tokens.shape == (2, 3)
