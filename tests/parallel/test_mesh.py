import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jgrpo.config import MeshConfig
from jgrpo.parallel.mesh import SAMPLE_RULES, TRAIN_RULES, logical_to_spec, make_mesh, mesh_shape, place


@pytest.mark.parametrize(
    "sizes, expected",
    [
        ((2, 2, 1, 2), (2, 2, 1, 2)),
        ((1, 8, 1, 1), (1, 8, 1, 1)),
        ((-1, 2, 1, 2), (2, 2, 1, 2)),
        ((1, -1, 1, 1), (1, 8, 1, 1)),
        ((2, -1, 1, 1), (2, 4, 1, 1)),
        ((1, -1, 4, 1), (1, 2, 4, 1)),  # experts over 4 devices, FSDP over 2 within
    ],
)
def test_mesh_shapes(sizes, expected):
    assert jax.device_count() == 8
    mesh = make_mesh(MeshConfig(data=sizes[0], fsdp=sizes[1], expert=sizes[2], tensor=sizes[3]))
    assert tuple(mesh.shape.values()) == expected
    assert mesh.axis_names == ("data", "fsdp", "expert", "tensor")
    assert mesh.devices.size == 8


@pytest.mark.parametrize(
    "sizes, pattern",
    [((3, -1, 1), "does not divide the 8"), ((2, 2, 1), "needs 4 devices but 8"), ((4, 4, 1), "needs 16 devices")],
)
def test_impossible_mesh_fails_clearly(sizes, pattern):
    with pytest.raises(ValueError, match=pattern):
        mesh_shape(MeshConfig(data=sizes[0], fsdp=sizes[1], tensor=sizes[2]), 8)


def test_mesh_on_one_device():
    mesh = make_mesh(MeshConfig(), devices=jax.devices()[:1])
    assert tuple(mesh.shape.values()) == (1, 1, 1, 1)


def test_logical_to_spec():
    assert logical_to_spec(P("embed", "mlp"), TRAIN_RULES) == P("fsdp", "tensor")
    assert logical_to_spec(P("embed", "mlp"), SAMPLE_RULES) == P(None, "tensor")
    assert logical_to_spec(P("batch", "length"), TRAIN_RULES) == P(("data", "fsdp", "expert"), None)
    assert logical_to_spec(P("layers", "experts", "embed", "expert_mlp"), TRAIN_RULES) == P(None, "expert", "fsdp",
                                                                                            "tensor")
    assert logical_to_spec(P("layers", None, "heads"), TRAIN_RULES) == P(None, None, "tensor")
    with pytest.raises(KeyError, match="'nonsense' has no rule"):
        logical_to_spec(P("nonsense"), TRAIN_RULES)


def test_place_pytree_with_expected_shardings():
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    tree = {
        "wq": np.ones((8, 4, 6), np.float32),  # embed, heads, head_dim
        "w_up": np.ones((8, 16), np.float32),  # embed, mlp
        "kv": np.ones((8, 3, 6), np.float32),  # 3 kv heads do not divide tensor=2: replicated on that dim
        "norm": np.ones((8,), np.float32),
    }
    logical = {
        "wq": P("embed", "heads", "head_dim"),
        "w_up": P("embed", "mlp"),
        "kv": P("embed", "kv_heads", "head_dim"),
        "norm": P("norm"),
    }
    placed = place(tree, logical, mesh, TRAIN_RULES)
    expect = {
        "wq": P("fsdp", "tensor", None),
        "w_up": P("fsdp", "tensor"),
        "kv": P("fsdp", None, None),
        "norm": P(None),
    }
    for k, spec in expect.items():
        assert isinstance(placed[k].sharding, NamedSharding)
        assert placed[k].sharding.spec == spec, k
        assert placed[k].sharding.mesh == mesh
        np.testing.assert_array_equal(np.asarray(placed[k]), tree[k])
    # sampling rules keep weights whole along fsdp
    sampled = place(tree, logical, mesh, SAMPLE_RULES)
    assert sampled["w_up"].sharding.spec == P(None, "tensor")
    assert sampled["w_up"].addressable_shards[0].data.shape == (8, 8)
