"""Expert parallelism (models/expert_parallel.py) on the 8-device CPU mesh: the experts split over the expert axis
give the unsplit layer's values and gradients, for rows that split over the group and rows that do not; a dense
model or an expert count the axis does not divide is a config error. A training run with mesh.expert = 2:
tests/training/test_moe_training.py."""


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
    (4, 8, "ragged", "all_gather"), (4, 8, "sorted_tiles", "ragged_all_to_all"),
    (4, 3, "sorted_tiles", "ragged_all_to_all"), (4, 8, "megablox", "ragged_all_to_all"),
    (4, 8, "megablox", "all_gather"),
    (1, 8, "megablox", "all_gather"),  # a Pallas kernel on a mesh without expert parallelism: per device
])  # (each layout once: the implementations agree with each other without a mesh, tests/models/test_moe.py)
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


def test_an_expert_axis_on_a_dense_model_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"mesh.expert=2 .* tiny-random-llama has no experts \(a dense model\)"):
        Trainer(tiny_config(tmp_path, *QUIET, "mesh.expert=2"))
