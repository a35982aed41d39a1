"""Off-policy (v > 1) iterations of the real trainer, checked against the closed form on its own tensors.

With v = 4 and the default `behaviour` ratio, iterations after a refresh sample from stale params. Every
quantity of such a stale update is recomputed here by an independent path (own sequence assembly, positions,
full-vocabulary log-softmax at the sampler's temperature, own group advantages from the decoded texts):
- the sampler samples with the params of the last refresh, not the current ones;
- its log-probs lp_alpha are the behaviour policy's log-probs of those very tokens (docs/algorithm.md §6);
- the trainer's loss and gradient equal -sum_t w_t * min(rho_t A, clip(rho_t, 1 - eps, 1 + eps) A) with
  rho = pi_theta / alpha and its gradient -sum_t w_t A rho_t 1[unclipped] d lp_t (docs/algorithm.md §3), with clipping
  present on both sides so the check has teeth.
A misalignment of rows, advantages, positions or tokens, a wrong lp as alpha, a temperature mismatch, a clip
on the wrong side or a behaviour copy that is not the refreshed params would each break one of these.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jgrpo.training.trainer as trainer_module
from jgrpo.models.llm import merge_model
from jgrpo.rl.objectives import step_normaliser
from jgrpo.sampling.sampler import Sampler  # the trainer samples through Sampler.generate
from tests.helpers import space_fraction, tiny_config

REFRESH, TEMPERATURE, EPS, ADV_EPS = 4, 0.7, 0.2, 1e-4


def _flat(tree) -> np.ndarray:
    return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)])


def _independent_logprobs(graphdef, params, sequences, mask, new_tokens):
    """[R, N] log-probs of the last N tokens of `sequences` [R, P+N]: plain full forward, explicit shift."""
    model = merge_model(graphdef, params)
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
    hidden, _ = model(sequences[:, :-1], positions[:, :-1], mask[:, :-1])  # [R, P+N-1, D]
    logits = jnp.einsum("btd,dv->btv", hidden[:, -new_tokens:], model.unembedding())  # [R, N, V]
    logp = jax.nn.log_softmax(logits / TEMPERATURE, axis=-1)
    return jnp.take_along_axis(logp, sequences[:, -new_tokens:, None], axis=-1)[..., 0]


@pytest.fixture(scope="module")
def stale_iterations(tmp_path_factory):
    """Run iterations 0 (refresh), 1 and 2 (stale) of a v=4 run; record what the sampler and the updates saw."""
    config = tiny_config(
        tmp_path_factory.mktemp("off_policy"),
        f"grpo.behaviour_refresh={REFRESH}", "grpo.off_policy_ratio=behaviour", "grpo.num_generations=8",
        "grpo.beta=0.0", f"grpo.clip_eps_low={EPS}", f"grpo.clip_eps_high={EPS}", f"grpo.advantage_eps={ADV_EPS}",
        f"sampler.temperature={TEMPERATURE}", "optim.learning_rate=3e-2", "checkpoint.every=0",
        "logging.samples_every=0",
    )
    samples, updates = [], []
    original_generate = Sampler.generate

    def spy_generate(self, params, prompts, key, version=0):
        out = original_generate(self, params, prompts, key, version)
        samples.append(dict(params=jax.tree.map(jnp.copy, params), prompt_tokens=np.asarray(prompts.tokens),
                            prompt_mask=np.asarray(prompts.mask), out=jax.device_get(out)))
        return out

    Sampler.generate = spy_generate
    trainer = trainer_module.Trainer(config)
    original_step = trainer.steps.updates.step

    def spy_step(params, opt_state, batch, minibatch, first, **plan_and_frozen):
        kept = jax.tree.map(jnp.copy, params)  # the step donates params
        new_params, new_opt_state, metrics = original_step(params, opt_state, batch, minibatch, first,
                                                           **plan_and_frozen)
        updates.append(dict(params=kept, batch=batch, first=first, metrics=jax.device_get(metrics)))
        return new_params, new_opt_state, metrics

    trainer.steps.updates.step = spy_step
    try:
        for _ in range(3):
            trainer.train_iteration()
        yield trainer, config, samples, updates
    finally:
        Sampler.generate = original_generate
        trainer.checkpointer.close()
        trainer.close()


def test_stale_iterations_sample_from_the_last_refresh(stale_iterations):
    _, _, samples, updates = stale_iterations
    refreshed = _flat(updates[0]["params"])  # the params at iteration 0, before its update
    for k in (1, 2):
        assert np.array_equal(_flat(samples[k]["params"]), refreshed), f"iteration {k} did not sample from pi_0"
        assert np.abs(_flat(updates[k]["params"]) - refreshed).max() > 1e-3, "the current params never moved"


@pytest.mark.parametrize("k", [1, 2])
def test_stale_update_matches_closed_form(stale_iterations, k):
    trainer, config, samples, updates = stale_iterations
    g, sample, update = config.grpo, samples[k], updates[k]
    out, G = sample["out"], g.num_generations
    N = out.tokens.shape[1]
    sequences = jnp.asarray(np.concatenate([np.repeat(sample["prompt_tokens"], G, 0), out.tokens], 1))
    mask = jnp.asarray(np.concatenate([np.repeat(sample["prompt_mask"], G, 0), out.completion_mask], 1))
    valid = np.asarray(out.completion_mask)

    # docs/algorithm.md §6: the sampler's log-probs are the behaviour policy's, at its temperature, token by token
    lp_behaviour = _independent_logprobs(trainer.graphdef, sample["params"], sequences, mask, N)
    np.testing.assert_allclose(np.where(valid, lp_behaviour, 0), np.where(valid, out.logprobs, 0), atol=1e-4)

    # advantages from the decoded completions, paper eq. 2 (population variance, eps inside the sqrt)
    texts = trainer.tokenizer.batch_decode([row[:n] for row, n in zip(out.tokens, out.lengths, strict=True)],
                                           skip_special_tokens=True)
    rewards = np.array([space_fraction("", t, {}) for t in texts]).reshape(-1, G)
    advantages = (rewards - rewards.mean(1, keepdims=True)) / np.sqrt(rewards.var(1, keepdims=True) + ADV_EPS)
    zero_variance = (rewards == rewards[:, :1]).all(1, keepdims=True)
    advantages = np.where(zero_variance, 0.0, advantages).reshape(-1, 1)  # [R, 1]
    loss_mask = valid & ~np.repeat(zero_variance, G, 0)  # zero-variance groups masked (the default)
    weights = loss_mask / loss_mask.sum()  # token_mean

    def lp_theta_fn(params):
        return _independent_logprobs(trainer.graphdef, params, sequences, mask, N)

    lp_theta, vjp = jax.vjp(lp_theta_fn, update["params"])
    ratio = np.exp(np.asarray(lp_theta, np.float64) - np.asarray(out.logprobs, np.float64))  # pi_theta / alpha
    clipped_low = (ratio < 1 - EPS) & (advantages < 0) & loss_mask
    clipped_high = (ratio > 1 + EPS) & (advantages > 0) & loss_mask
    assert clipped_low.sum() > 0 and clipped_high.sum() > 0, "the stale ratios must reach both clip edges"
    surrogate = np.where(clipped_low, (1 - EPS) * advantages,
                         np.where(clipped_high, (1 + EPS) * advantages, ratio * advantages))
    loss = -(weights * surrogate).sum()
    coefficient = -weights * advantages * ratio * ~(clipped_low | clipped_high)  # d loss / d lp_theta
    grad = _flat(vjp(jnp.asarray(coefficient, jnp.float32))[0])

    metrics = update["metrics"]
    np.testing.assert_allclose(float(metrics["loss"]), loss, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(float(metrics["clip_frac_low"]), clipped_low.sum() / loss_mask.sum(), atol=1e-6)
    np.testing.assert_allclose(float(metrics["clip_frac_high"]), clipped_high.sum() / loss_mask.sum(), atol=1e-6)
    np.testing.assert_allclose(float(metrics["grad_norm"]), np.linalg.norm(grad), rtol=1e-4)

    # the full gradient of the trainer's loss (the function its jitted step differentiates) on its own batch
    micro = jax.tree.map(lambda x: x[0], update["batch"])  # one chunk: a single micro-batch
    norm = step_normaliser(micro.completion_mask, micro.adv.in_loss, g, max_new_tokens=N)
    steps = trainer.steps

    def trainer_loss(params):  # the padded layout's forward and the update's objective, as its step runs them
        forward = steps.layout.forward(params, micro, with_kl=g.beta > 0)
        return steps.updates._objective(forward, micro, g.micro_batches, norm=norm, first_update=update["first"])[0]

    trainer_grad = _flat(jax.grad(trainer_loss)(update["params"]))
    assert np.linalg.norm(trainer_grad - grad) <= 1e-4 * np.linalg.norm(grad)
