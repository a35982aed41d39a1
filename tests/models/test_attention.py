"""The hand-written attention backward == autodiff of the plain softmax formula."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jgrpo.models.attention import attention
from tests.helpers import reference_attention


@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (3, 3), (6, 1)])
def test_values_and_gradients_match_autodiff(heads, kv_heads):
    B, T, Dh = 3, 7, 8
    rng = np.random.default_rng(heads * 10 + kv_heads)
    q = jnp.asarray(rng.normal(size=(B, T, heads, Dh)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(B, T, kv_heads, Dh)), jnp.float32) for _ in range(2))
    # Causal, rows left-padded by 0, 2 and 4 tokens: padding queries have nothing allowed at all.
    real = np.arange(T)[None, :] >= np.array([[0], [2], [4]])
    allowed = jnp.asarray(np.tril(np.ones((T, T), bool))[None] & real[:, None, :])
    assert not np.asarray(allowed).any(axis=-1).all()  # some query rows are fully masked

    np.testing.assert_allclose(attention(q, k, v, allowed), reference_attention(q, k, v, allowed), atol=1e-6)
    weights = jnp.asarray(rng.normal(size=(B, T, heads, Dh)), jnp.float32)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v, allowed) * weights)

    ours = jax.grad(loss(attention), argnums=(0, 1, 2))(q, k, v)
    theirs = jax.grad(loss(reference_attention), argnums=(0, 1, 2))(q, k, v)
    for name, a, b in zip("qkv", ours, theirs, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, err_msg=f"d{name}")


def test_saves_no_score_sized_residuals():
    """What the backward keeps is O(T), not O(T^2): the reason this function exists."""
    B, T, H, Dh = 2, 64, 4, 8
    q = k = v = jnp.ones((B, T, H, Dh), jnp.float32)
    allowed = jnp.ones((B, T, T), bool)
    _, residuals = jax.vjp(lambda q, k, v: attention(q, k, v, allowed), q, k, v)
    sizes = [x.size for x in jax.tree.leaves(residuals) if x.dtype != jnp.bool_]
    assert max(sizes) <= B * T * H * Dh  # q, k, v, out; never B * H * T * T
