"""The mixture-of-experts MLP (models/moe.py): routing by hand, the expert implementations against each other,
and Qwen3-MoE against transformers (logits, greedy decoding, export)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jgrpo.models.hf import export_hf, load_model
from jgrpo.models.llm import abstract_model
from jgrpo.models.moe import IMPLEMENTATIONS, moe_mlp, resolve_moe_impl, route, router_losses, router_stats, tile_rows
from tests.helpers_models import hf_logits, jgrpo_logits, left_padded_batch, save_hf_model


def test_routing_by_hand():
    # Two tokens, three experts, k = 2; the router is the identity so the logits are the tokens themselves.
    h = jnp.array([[2.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    ids, gates, logits = route(h, jnp.eye(3), 2, norm_topk_prob=False)
    e = np.exp([2.0, 0.0, 1.0])
    p = e / e.sum()  # 0.6652, 0.0900, 0.2447
    np.testing.assert_array_equal(logits, h)
    np.testing.assert_array_equal(ids[0], [0, 2])
    np.testing.assert_allclose(gates[0], [p[0], p[2]], rtol=1e-6)
    np.testing.assert_allclose(gates[1], [1 / 3, 1 / 3], rtol=1e-6)  # a tie: equal gates whichever two win
    _, normed, _ = route(h, jnp.eye(3), 2, norm_topk_prob=True)
    np.testing.assert_allclose(normed[0], [p[0] / (p[0] + p[2]), p[2] / (p[0] + p[2])], rtol=1e-6)


def _weights(E=8, D=16, F=12, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    router = jax.random.normal(keys[0], (D, E)) * 0.5
    router = router.at[:, E - 1].set(-100.0 * jnp.abs(router[:, E - 1]))  # expert E-1 wins no token (h > 0)
    return {"router": router, "experts_gate": jax.random.normal(keys[1], (E, D, F)) * 0.3,
            "experts_up": jax.random.normal(keys[2], (E, D, F)) * 0.3,
            "experts_down": jax.random.normal(keys[3], (E, F, D)) * 0.3}


@pytest.mark.parametrize("tokens", [3, 300], ids=["decode", "train"])  # one tile per expert; many
def test_implementations_agree_in_values_and_gradients(tokens):
    p = _weights()
    h = jnp.abs(jax.random.normal(jax.random.key(1), (1, tokens, 16)))

    def loss(h, p, impl):
        out, ids, _ = moe_mlp(h, p, k=2, norm_topk_prob=True, impl=impl)
        return jnp.sum(out * jnp.cos(out)), (out, ids)

    results = {impl: jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True), static_argnums=2)(h, p, impl)
               for impl in IMPLEMENTATIONS}
    (_, (reference, ids)), grads = results.pop("dense")
    assert not (np.asarray(ids) == 7).any()  # an expert without a token is part of every case
    assert float(jnp.abs(grads[1]["router"]).max()) > 0  # the gates carry gradient to the router
    for impl, ((_, (out, impl_ids)), impl_grads) in results.items():
        np.testing.assert_array_equal(impl_ids, ids)
        np.testing.assert_allclose(out, reference, atol=1e-5, rtol=1e-5, err_msg=impl)
        for got, want in zip(jax.tree.leaves(impl_grads), jax.tree.leaves(grads), strict=True):
            np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4, err_msg=impl)
        assert float(jnp.abs(impl_grads[1]["experts_gate"][7]).max()) == 0  # the idle expert learns nothing


def test_megablox_skips_padding_assignments_and_gives_them_zero_rows():
    # Expert id E (one past the last) marks padding, e.g. expert parallelism's static receive buffer: the kernel
    # leaves those rows unvisited (uninitialised: NaN in interpret mode before they are zeroed), so they cost
    # nothing. Values and gradients equal the dense reference without those assignments.
    p = _weights()
    x = jnp.abs(jax.random.normal(jax.random.key(2), (24, 16)))
    ids = jax.random.randint(jax.random.key(3), (24, 1), 0, 7).at[15:].set(8)  # 9 padding rows at the end
    gates = jnp.ones((24, 1))
    weights = (p["experts_gate"], p["experts_up"], p["experts_down"])

    def loss(impl, x, weights, ids):
        y = IMPLEMENTATIONS[impl](x, ids, gates, *weights)
        return jnp.sum(y * jnp.cos(y)), y

    step = jax.jit(jax.value_and_grad(loss, argnums=(1, 2), has_aux=True), static_argnums=0)
    got, got_grads = step("megablox", x, weights, ids)
    kept = ids < 8
    want, want_grads = step("dense", jnp.where(kept, x, 0), weights, jnp.where(kept, ids, 0))
    np.testing.assert_array_equal(got[1][15:], 0)
    np.testing.assert_allclose(got[1], want[1], atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(got_grads[0][15:], 0)
    for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)


def test_tiles_track_the_even_load_and_auto_resolves_per_platform():
    assert tile_rows(16, 8) == 8 and tile_rows(600, 8) == 128 and tile_rows(200, 8) == 32
    assert [resolve_moe_impl("auto", p) for p in ("cpu", "tpu", "gpu")] == ["sorted_tiles", "megablox", "sorted_tiles"]
    assert resolve_moe_impl("dense", "gpu") == "dense"


def _router_margin(hf_model, tokens, mask) -> float:
    """The smallest gap, over tokens and MoE layers, between the k-th and (k+1)-th router probability:
    parity is only meaningful when float32 rounding cannot flip a top-k choice."""
    k, margins = hf_model.config.num_experts_per_tok, []

    def hook(module, inputs, output):
        probs = torch.softmax(output[0].float(), dim=-1).sort(dim=-1, descending=True).values
        margins.append(float((probs[:, k - 1] - probs[:, k]).min()))

    routers = [layer.mlp.gate for layer in hf_model.model.layers if hasattr(layer.mlp, "experts")]
    handles = [router.register_forward_hook(hook) for router in routers]
    hf_logits(hf_model, tokens, mask)
    for handle in handles:
        handle.remove()
    return min(margins)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_moe_plain", "qwen3_moe_step2"])
def test_qwen3_moe_matches_transformers(family, tmp_path):
    model_dir, hf_model = save_hf_model(family, tmp_path / family)
    graphdef, params, cfg = load_model(str(model_dir))
    assert cfg.num_experts == 8 and cfg.experts_per_token == 2
    plain = family == "qwen3_moe_plain"
    assert cfg.norm_topk_prob == (not plain) and cfg.head_dim == (16 if plain else 24)
    assert cfg.decoder_sparse_step == (2 if family == "qwen3_moe_step2" else 1)
    tokens, mask = left_padded_batch()
    margin = _router_margin(hf_model, tokens, mask)
    print(f"{family}: smallest router top-k margin {margin:.2e}")
    assert margin > 1e-4
    ref = hf_logits(hf_model, tokens, mask)[mask]
    tolerance = max(1e-4, 1e-5 * np.abs(ref).max())
    # Every implementation on one family (they agree with each other on any routing: the test above); the other
    # families on the loaded default (sorted_tiles) only.
    for impl in IMPLEMENTATIONS if family == "qwen3_moe" else (cfg.moe_impl,):
        graphdef, _ = abstract_model(dataclasses.replace(cfg, moe_impl=impl))
        np.testing.assert_allclose(jgrpo_logits(graphdef, params, tokens, mask)[mask], ref, atol=tolerance, rtol=0,
                                   err_msg=impl)
    export_hf(params, cfg, None, tmp_path / "out")  # per-expert tensors again, as transformers saves them
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    np.testing.assert_allclose(hf_logits(reloaded, tokens, mask)[mask], ref, atol=1e-5, rtol=0)


def _hf_moe_config(layers, **changes):
    return {"model_type": "qwen3_moe", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
            "num_hidden_layers": layers, "num_attention_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 4, **changes}


@pytest.mark.parametrize("layers,changes,step", [
    (4, {"decoder_sparse_step": 2}, 2),
    (6, {"decoder_sparse_step": 3, "mlp_only_layers": [0, 4]}, 3),  # naming dense layers only: still period 3
    (4, {"mlp_only_layers": [0, 2]}, 2),  # every layer sparse but the even ones: the period-2 stack
])
def test_periodic_moe_layouts_load_as_their_period(layers, changes, step):
    from jgrpo.models.hf import llm_config_from_hf

    assert llm_config_from_hf(_hf_moe_config(layers, **changes)).decoder_sparse_step == step


@pytest.mark.parametrize("layers,changes,message", [
    (2, {"mlp_only_layers": [1]}, r"mlp_only_layers=\[1\] makes layers \[0\] of 2"),
    (3, {"decoder_sparse_step": 2}, r"decoder_sparse_step=2 .* makes layers \[1\] of 3"),  # a dense layer at the end
    (4, {"mlp_only_layers": [3]}, r"layers \[0, 1, 2\] of 4"),
])
def test_unsupported_moe_layouts_are_named(layers, changes, message):
    from jgrpo.config import ConfigError
    from jgrpo.models.hf import llm_config_from_hf

    with pytest.raises(ConfigError, match=message):
        llm_config_from_hf(_hf_moe_config(layers, **changes))


@pytest.mark.parametrize("name,active", [("Qwen/Qwen3-30B-A3B", 3.3e9), ("Qwen3-235B-A22B", 22.2e9)])
def test_the_planners_qwen3_moe_shapes_activate_the_published_sizes(name, active):
    # Model cards: 3.3B of 30.5B parameters activated; 22B of 235B (totals: tests/planning/test_plan.py). The
    # planner's model FLOPs count the activated matmul parameters (roofline.matmul_params).
    import math

    from jgrpo.models.parameters import weight_specs
    from jgrpo.models.shapes import model_shapes
    from jgrpo.planning.roofline import matmul_params

    cfg = model_shapes(name)
    norms = sum(math.prod(spec.shape) for path, spec in weight_specs(cfg).items() if path[-1].endswith("norm"))
    embedding = cfg.vocab_size * cfg.hidden_size
    assert matmul_params(cfg) + embedding + norms == pytest.approx(active, rel=0.02)


def _reference_with_ids(h, p, ids, norm_topk_prob):
    """The MoE block written out per token: its forced experts' SwiGLU outputs weighted by the router's float32
    softmax at those experts (renormalised over them when asked)."""
    x = h.reshape(-1, h.shape[-1])
    probs = jax.nn.softmax((x @ p["router"]).astype(jnp.float32), axis=-1)
    gates = jnp.take_along_axis(probs, ids, axis=-1)
    if norm_topk_prob:
        gates = gates / gates.sum(-1, keepdims=True)

    def expert(e, xi):
        return (jax.nn.silu(xi @ p["experts_gate"][e]) * (xi @ p["experts_up"][e])) @ p["experts_down"][e]

    out = jnp.stack([sum(gates[m, j] * expert(ids[m, j], x[m]) for j in range(ids.shape[1]))
                     for m in range(x.shape[0])])
    return out.reshape(h.shape)


@pytest.mark.parametrize("norm_topk_prob,implementations", [(True, tuple(IMPLEMENTATIONS)),
                                                           (False, ("dense", "sorted_tiles"))])
def test_replayed_experts_run_whatever_the_router_says_and_the_router_keeps_its_gradient(norm_topk_prob,
                                                                                         implementations):
    # Replayed ids enter before the dispatch every implementation shares: all of them once, both gate forms on two.
    p = _weights()
    h = jnp.abs(jax.random.normal(jax.random.key(2), (1, 6, 16)))
    top, _, _ = route(h.reshape(6, 16), p["router"], 2, norm_topk_prob)
    forced = np.asarray(top).copy()
    forced[0] = [7, 3]  # expert 7 is never in a top k (its router column is very negative); 3 maybe
    forced[1] = forced[1, ::-1]  # the same experts in the other order
    forced[4] = [5, 6]
    forced = jnp.asarray(forced)

    def loss(fn, h, p):
        return jnp.sum(jnp.sin(fn(h, p)))

    want, want_grads = jax.value_and_grad(functools.partial(loss, lambda h, p: _reference_with_ids(
        h, p, forced, norm_topk_prob)), argnums=(0, 1))(h, p)
    assert float(jnp.abs(want_grads[1]["router"]).max()) > 1e-3

    def replayed(h, p, impl):
        out, ids, _ = moe_mlp(h, p, k=2, norm_topk_prob=norm_topk_prob, impl=impl, ids=forced.reshape(1, 6, 2))
        return jnp.sum(jnp.sin(out)), ids

    for impl in implementations:
        (got, ids), grads = jax.jit(jax.value_and_grad(replayed, argnums=(0, 1), has_aux=True), static_argnums=2)(
            h, p, impl)
        np.testing.assert_array_equal(ids.reshape(6, 2), top)  # what the router picks, not what was replayed
        np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=impl)
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4, err_msg=impl)


def test_the_model_returns_its_routing_and_replaying_it_changes_nothing(tmp_path):
    from jgrpo.models.llm import merge_model, position_ids_from_mask

    graphdef, params, cfg = load_model(str(save_hf_model("qwen3_moe", tmp_path / "m")[0]))
    tokens, mask = (jnp.asarray(x) for x in left_padded_batch())
    model = merge_model(graphdef, params)
    hidden, _, routing = model.routed(tokens, position_ids_from_mask(mask), mask)
    assert routing.shape == (*tokens.shape, cfg.num_layers, 2) and routing.dtype == jnp.int32
    replayed, _, again = model.routed(tokens, position_ids_from_mask(mask), mask, routing=routing)
    np.testing.assert_array_equal(replayed, hidden)
    np.testing.assert_array_equal(again, routing)
    other = jnp.roll(routing, 1, axis=-2)  # each layer gets the other layer's experts: a different network
    changed, _, _ = model.routed(tokens, position_ids_from_mask(mask), mask, routing=other)
    assert float(jnp.abs(changed - hidden)[mask].max()) > 1e-3


def test_router_losses_by_hand_and_as_transformers_computes_the_load_balance():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    # Two tokens, two experts, k = 1: probabilities [.5, .5] and [.75, .25], both tokens on expert 0.
    logits = jnp.log(jnp.asarray([[1.0, 1.0], [3.0, 1.0]]))
    aux, z = router_losses(router_stats(logits, jnp.asarray([[0], [0]]), jnp.ones(2, bool)))
    # E * sum_e (assignments_e / T)(probability_e / T) = 2 * (2/2 * 1.25/2 + 0) = 1.25; z: mean of lse^2.
    np.testing.assert_allclose(aux, 1.25, rtol=1e-6)
    np.testing.assert_allclose(z, (np.log(2.0) ** 2 + np.log(4.0) ** 2) / 2, rtol=1e-6)
    # Three layers' logits over 2 x 5 tokens with padding: every layer's real tokens pooled, as transformers does.
    layers = jax.random.normal(jax.random.key(0), (3, 10, 8))
    mask = jnp.asarray([[True] * 5, [False, False, True, True, True]]).reshape(-1)
    stats = [router_stats(x, jax.lax.top_k(jax.nn.softmax(x), 2)[1], mask) for x in layers]
    aux, _ = router_losses(jax.tree.map(lambda *xs: jnp.stack(xs), *stats))
    want = load_balancing_loss_func(tuple(torch.from_numpy(np.asarray(x)) for x in layers), num_experts=8, top_k=2,
                                    attention_mask=torch.from_numpy(np.asarray(mask).reshape(2, 5)))
    np.testing.assert_allclose(aux, want.item(), rtol=1e-5)
    # Its gradient reaches the router (through the probabilities; the assignments are counts).
    grad = jax.grad(lambda x: router_losses(router_stats(x, jax.lax.top_k(x, 2)[1], mask))[0])(layers[0])
    assert float(jnp.abs(grad).max()) > 1e-4


def test_a_periodic_stack_stacks_each_weight_over_its_layers_and_lora_adapts_its_dense_mlps():
    # decoder_sparse_step 2 over 4 layers: attention stacks 4, the dense MLPs (layers 0, 2) and the experts
    # (layers 1, 3) 2 each; LoRA keeps its MLP targets (the dense layers') and exports them under their layers.
    from jgrpo.models.layer_stack import stacked_layers, unstack_layers
    from jgrpo.models.llm import LLMConfig
    from jgrpo.models.lora import LORA_TARGETS, with_lora
    from jgrpo.models.parameters import param_specs
    from jgrpo.models.peft_format import peft_tensors

    cfg = LLMConfig(vocab_size=16, hidden_size=8, intermediate_size=12, num_layers=4, num_heads=2, num_kv_heads=2,
                    head_dim=4, architecture="qwen3_moe", qk_norm=True, num_experts=4, experts_per_token=2,
                    moe_intermediate_size=6, decoder_sparse_step=2)
    assert [stacked_layers(cfg, n) for n in ("q", "gate", "router", "up_lora_a")] == [[0, 1, 2, 3], [0, 2], [1, 3],
                                                                                       [0, 2]]
    lora = with_lora(cfg, 2, 4.0, LORA_TARGETS)
    assert lora.lora_targets == LORA_TARGETS
    shapes = {path: spec.shape for path, spec in param_specs(lora).items()}
    assert shapes[("layers", "q")][0] == 4 and shapes[("layers", "gate")] == (2, 8, 12)
    assert shapes[("layers", "experts_up")] == (2, 4, 8, 6) and shapes[("layers", "gate_lora_a")] == (2, 8, 2)
    stacks = {name[1]: np.full(shape, float(i), np.float32)
              for i, (name, shape) in enumerate(shapes.items()) if name[0] == "layers"}
    stacks = {name: w + np.arange(w.shape[0]).reshape(-1, *[1] * (w.ndim - 1)) * 100 for name, w in stacks.items()}
    layers = unstack_layers(lora, stacks)
    moe = {"router", "experts_gate", "experts_up", "experts_down"}
    dense = {n for n in stacks if n.split("_lora")[0] in ("gate", "up", "down")}
    assert set(layers[2]) == set(stacks) - moe and set(layers[3]) == set(stacks) - dense
    np.testing.assert_array_equal(layers[2]["gate"], stacks["gate"][1])  # layer 2 is the second dense layer
    np.testing.assert_array_equal(layers[3]["router"], stacks["router"][1])
    np.testing.assert_array_equal(layers[3]["q"], stacks["q"][3])
    adapters = {"layers": {n: w for n, w in stacks.items() if n.endswith(("_lora_a", "_lora_b"))}}
    names = sorted(peft_tensors(adapters, lora))
    assert "base_model.model.model.layers.2.mlp.gate_proj.lora_A.weight" in names
    assert not any(".layers.1.mlp" in n or ".layers.3.mlp" in n for n in names)
