"""Expert parallelism (models/expert_parallel.py) on the 8-device CPU mesh: the experts split over the expert axis
give the unsplit layer's values and gradients, for rows that split over the group and rows that do not; a
training run with mesh.expert = 2 samples and trains with them; a dense model or an expert count the axis does
not divide is a config error."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jgrpo.config import ConfigError, MeshConfig
from jgrpo.models.moe import moe_mlp
from jgrpo.parallel.mesh import make_mesh
from jgrpo.training.trainer import Trainer
from tests.helpers import QUIET, tiny_config
from tests.models.test_moe import _weights


def _loss(h, p, impl, dispatch="all_gather"):
    out, _, _ = moe_mlp(h, p, k=2, norm_topk_prob=True, impl=impl, dispatch=dispatch)
    return jnp.sum(out * jnp.cos(out)), out


@pytest.mark.parametrize("expert,rows,impl,dispatch", [
    (2, 8, "sorted_tiles", "all_gather"), (4, 8, "sorted_tiles", "all_gather"), (4, 3, "sorted_tiles", "all_gather"),
    (4, 8, "ragged", "all_gather"), (2, 8, "sorted_tiles", "ragged_all_to_all"),
    (4, 8, "sorted_tiles", "ragged_all_to_all"), (4, 3, "sorted_tiles", "ragged_all_to_all"),
    (4, 8, "megablox", "ragged_all_to_all"), (4, 8, "megablox", "all_gather"), (4, 3, "megablox", "all_gather"),
    (1, 8, "megablox", "all_gather"),  # a Pallas kernel on a mesh without expert parallelism: per device
])
def test_split_experts_give_the_unsplit_layers_values_and_gradients(expert, rows, impl, dispatch):
    # rows = 8 split over data x fsdp x expert (all_gather + reduce-scatter, or each assignment to its expert's
    # device and back: on CPU the op's pure-JAX emulation); 3 rows split over nothing (each device runs its experts
    # on all of them, a sum over the group).
    p = _weights()
    h = jnp.abs(jax.random.normal(jax.random.key(1), (rows, 5, 16)))
    step = jax.value_and_grad(_loss, argnums=(0, 1), has_aux=True)
    (_, want), want_grads = jax.jit(step, static_argnums=2)(h, p, impl)
    mesh = make_mesh(MeshConfig(data=1, fsdp=8 // expert, expert=expert, tensor=1))
    experts = NamedSharding(mesh, PartitionSpec("expert"))
    placed = {name: jax.device_put(w, experts if name.startswith("experts") else NamedSharding(mesh, PartitionSpec()))
              for name, w in p.items()}
    tokens = NamedSharding(mesh, PartitionSpec(("fsdp", "expert")) if rows == 8 else PartitionSpec())
    compiled = jax.jit(step, static_argnums=(2, 3))
    with jax.set_mesh(mesh):
        lowered = compiled.lower(jax.device_put(h, tokens), placed, impl, dispatch).as_text()
        (_, got), got_grads = compiled(jax.device_put(h, tokens), placed, impl, dispatch)
    assert "all_gather" in lowered if rows == 8 and expert > 1 else "all_gather" not in lowered
    if expert > 1:
        assert got_grads[1]["experts_gate"].sharding.spec[0] == "expert"  # each device's experts stay its own
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)


def test_a_run_with_experts_split_samples_and_trains_consistently(tmp_path):
    # The tiny Qwen3-MoE with its 8 experts over 2 devices (data-parallel over them elsewhere): the sampler's
    # decode and prefill, the trainer's forwards and the update run split; float32, so the trainer's log-probs are
    # the sampler's and the replayed routing agrees everywhere.
    config = tiny_config(tmp_path, "model.name=tiny-random-qwen3-moe", *QUIET, "mesh.expert=2",
                         "model.routing_replay=rollout", "run.iterations=1")
    trainer = Trainer(config)
    try:
        assert dict(trainer.mesh.shape)["expert"] == 2
        assert trainer.state.params["layers"]["experts_up"].sharding.spec[1] == "expert"
        assert trainer.run() == "done"
    finally:
        trainer.close()
    first = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert first["loss/grad_norm"] > 0 and first["mismatch/logprob_max"] < 1e-5
    assert first["moe/routing_mismatch"] == 0


def test_an_expert_axis_on_a_dense_model_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"mesh.expert=2 .* tiny-random-llama has no experts \(a dense model\)"):
        Trainer(tiny_config(tmp_path, *QUIET, "mesh.expert=2"))
