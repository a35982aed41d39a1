"""Which attention implementation the model runs (`model.attention`), chosen per backend.

Every implementation computes the same thing: softmax(q k^T / sqrt(Dh)) v over the allowed key slots, with
grouped-query heads. The padded forwards (training, scoring, prefill) only ever need one mask shape: the T
queries are the last T of the S key slots, each sees the slots up to its own and only real (unpadded) ones.
`causal_attention` takes exactly that, so the Pallas kernel can express it as a static causal mask plus
per-row segment ids. `masked_attention` takes a mask per row (the packed forward's), and `dense_attention` serves
the rare caller with an arbitrary mask (a cache filled at a traced offset).

- `custom`: `jgrpo.models.attention`, plain XLA ops with a hand-written backward that keeps O(T) residuals.
  Fastest on CPU (measured: docs/configuration.md).
- `xla`: `jax.nn.dot_product_attention(implementation="xla")`: XLA's own formula and autodiff.
- `cudnn`: the same call with cuDNN's fused flash attention (NVIDIA GPUs only; not yet the GPU default).
- `splash`: the Pallas TPU splash-attention kernel (block-sparse flash attention, never materialises the
  [T, S] scores), under `shard_map` over the context mesh. On a CPU it runs in Pallas interpret mode
  (for tests only: slow).
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jgrpo.models.attention import attention as custom_attention
from jgrpo.parallel.mesh import BATCH_AXES, context_platform, dividing_axes
from jgrpo.parallel.platform_defaults import resolve

IMPLEMENTATIONS = ("custom", "xla", "cudnn", "splash")
# What `auto` picks by the platform of the mesh's devices (reasons: docs/configuration.md, model.attention).
# On an H100 (jax 0.11.2) cudnn gave NaN gradients in every GRPO update and asked for 62.6 GiB in a Qwen2.5-0.5B
# step that custom runs: GPUs take custom until cudnn's fix is measured (benchmarks/accelerator.py).
AUTO = {"cpu": "custom", "tpu": "splash", "gpu": "custom", "other": "xla"}
_SPLASH_BLOCK = 128  # query and key block of the kernel (the TPU lane width); sequences are padded to it


def resolve_attention(choice: str, platform: str) -> str:
    """The implementation `choice` ("auto" or one of IMPLEMENTATIONS) means on devices of `platform`."""
    return resolve("model.attention", choice, IMPLEMENTATIONS, AUTO, platform)


def mesh_context(cfg, mesh):
    """The context to trace (call or lower) programs of the model `cfg` (an `llm.LLMConfig`) in: `jax.set_mesh(mesh)`
    where a part of it is placed per device with `shard_map` (the splash kernel, experts split over the expert
    axis: models/expert_parallel.py), nothing otherwise."""
    return mesh_context_factory(cfg, mesh)()


def mesh_context_factory(cfg, mesh):
    """`mesh_context`'s choice made once: a callable that gives the context (for objects that trace every call)."""
    experts_split = "expert" in getattr(mesh, "axis_names", ()) and mesh.shape["expert"] > 1
    per_device = cfg.attention == "splash" or (cfg.num_experts and (experts_split or cfg.moe_impl == "megablox"))
    if per_device and mesh is not None:
        return functools.partial(jax.set_mesh, mesh)
    return contextlib.nullcontext


def causal_attention(implementation: str, q: jax.Array, k: jax.Array, v: jax.Array, kv_valid: jax.Array):
    """Queries q [B, T, H, Dh] are the last T of the S key slots of k, v [B, S, KVH, Dh]; query t sees slot s
    when s <= t + S - T and kv_valid[b, s] (bool [B, S]). -> [B, T, H, Dh].

    Queries at invalid slots get some finite output (they attend to invalid slots only): callers mask them.
    """
    T, S = q.shape[1], k.shape[1]
    if implementation == "splash":
        if _splits_evenly(q.shape[0], k.shape[2]):
            return _splash(q, k, v, kv_valid=kv_valid)
        implementation = "xla"  # the kernel would run whole on every device: let the partitioner split xla's
    return dense_attention(implementation, q, k, v, slot_mask(jnp.arange(T) + (S - T), kv_valid))


def slot_mask(query_slots: jax.Array, kv_valid: jax.Array) -> jax.Array:
    """[B, T, S] bool: query t (at slot query_slots[t]) sees slot s <= its own where kv_valid[b, s]."""
    return (jnp.arange(kv_valid.shape[1])[None, :] <= query_slots[:, None])[None] & kv_valid[:, None, :].astype(bool)


def dense_attention(implementation: str, q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array):
    """Attention under any mask allowed [B, T, S]; `splash` (a static mask only) falls back to `xla`."""
    if implementation == "custom":
        return custom_attention(q, k, v, allowed)
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"unknown attention implementation '{implementation}'; one of {IMPLEMENTATIONS}")
    if implementation != "cudnn":
        return jax.nn.dot_product_attention(q, k, v, mask=allowed[:, None], implementation="xla")
    T = q.shape[1]
    q, k, v, allowed = cudnn_inputs(q, k, v, allowed)
    return jax.nn.dot_product_attention(q, k, v, mask=allowed[:, None], implementation="cudnn")[:, :T]


def cudnn_inputs(q, k, v, allowed):
    """q, k, v, allowed as cuDNN's fused attention takes them. It takes a mask as a bias, and with a bias its
    training kernels refuse odd lengths (jax 0.11.2 on an H100: "Unsupported sequence length Q 199, KV 327"):
    T and S are padded to even, an extra key masked off for every query. And a query that sees no key (a
    padding slot, or the extra query) is let see key 0: its softmax over only masked keys is 0/0 in a flash
    kernel's backward. Such rows are cut off or masked by the caller, so they send no gradient."""
    T, S = q.shape[1], k.shape[1]
    pad_t, pad_s = T % 2, S % 2
    q = jnp.pad(q, ((0, 0), (0, pad_t), (0, 0), (0, 0)))
    k, v = (jnp.pad(x, ((0, 0), (0, pad_s), (0, 0), (0, 0))) for x in (k, v))
    return q, k, v, _key_0_for_the_blind(jnp.pad(allowed, ((0, 0), (0, pad_t), (0, pad_s))))


def _key_0_for_the_blind(allowed: jax.Array) -> jax.Array:
    """allowed [B, T, S] with key 0 let in for every query that sees no key: a flash kernel's softmax over only
    masked keys is 0/0 (cuDNN's backward; splash skips such a query's blocks). Callers mask those queries."""
    return allowed.at[:, :, 0].set(allowed[:, :, 0] | ~jnp.any(allowed, axis=-1))


def masked_attention(implementation: str, q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array):
    """Attention under a per-row mask allowed [B, T, S] that no causal mask plus segment ids can express (the packed
    forward's: a completion sees its group's prompt and its own segment; models/packed_forward.py). `splash` runs
    the kernel with each row's mask as data (a "dynamic" mask: it skips the key blocks a query block sees nothing
    of and masks the rest elementwise, never materialising the scores); the others are `dense_attention`."""
    if implementation == "splash" and _splits_evenly(q.shape[0], k.shape[2]):
        return _splash(q, k, v, allowed=allowed)
    return dense_attention(implementation, q, k, v, allowed)


def _splash(q, k, v, kv_valid=None, allowed=None):
    """Splash attention under `causal_attention`'s mask (from kv_valid [B, S]) or, with `allowed` [B, T, S], under
    any mask per row."""
    B, T, H, Dh = q.shape
    S, KVH = k.shape[1], k.shape[2]
    # Pad both sequences at the front to whole blocks. Causal: the front keys are padding (segment 0), so the
    # mask's relation "queries are the last T of the S slots" survives as a causal mask with offset Sp - Tp; at
    # least one padding key when queries are padded: every padded query then sees key 0 (no empty softmax).
    pad_q = -T % _SPLASH_BLOCK
    if allowed is None:
        pad_kv = -S % _SPLASH_BLOCK or (_SPLASH_BLOCK if pad_q else 0)
        valid = jnp.pad(kv_valid.astype(jnp.int32), ((0, 0), (pad_kv, 0)))  # [B, Sp]
        per_row = (valid[:, valid.shape[1] - T - pad_q:], valid)  # a query's segment is its own slot's
    else:
        pad_kv = -S % _SPLASH_BLOCK
        allowed = jnp.pad(allowed.astype(bool), ((0, 0), (pad_q, 0), (pad_kv, 0)))
        per_row = (_key_0_for_the_blind(allowed),)  # a padding query: its blocks all skipped, it would divide 0 by 0
    q = jnp.pad(q * jnp.asarray(Dh**-0.5, q.dtype), ((0, 0), (pad_q, 0), (0, 0), (0, 0)))
    k, v = (jnp.pad(x, ((0, 0), (pad_kv, 0), (0, 0), (0, 0))) for x in (k, v))
    # Kernel layouts: q [B, KVH, G, Tp, Dh] (one multi-query kernel per kv head), k, v [B, KVH, Sp, Dh].
    q = q.reshape(B, T + pad_q, KVH, H // KVH, Dh).transpose(0, 2, 3, 1, 4)
    k, v = (x.transpose(0, 2, 1, 3) for x in (k, v))
    mesh = jax.sharding.get_abstract_mesh()
    interpret = context_platform() != "tpu"  # Pallas TPU kernels run elsewhere only in the (slow) interpreter

    if allowed is None:
        kernel = _splash_kernel(H // KVH, T + pad_q, S + pad_kv, interpret)

        def one_row(q, k, v, qs, ks):
            from jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_kernel import SegmentIds

            return jax.vmap(lambda q, k, v: kernel(q, k, v, segment_ids=SegmentIds(q=qs, kv=ks)))(q, k, v)
    else:
        def one_row(q, k, v, mask):
            return jax.vmap(_masked_splash_kernel(mask[None], interpret))(q, k, v)  # one mask for every head

    def per_device(q, k, v, *row_data):
        return jax.vmap(one_row)(q, k, v, *row_data)

    if not mesh.empty:  # rows over the batch axes, kv heads over tensor (as the projections shard them)
        rows = dividing_axes(mesh, BATCH_AXES, B)
        heads = dividing_axes(mesh, ("tensor",), KVH)
        qkv, row = PartitionSpec(rows, heads), PartitionSpec(rows)
        per_device = jax.shard_map(per_device, mesh=mesh, in_specs=(qkv, qkv, qkv, *[row] * len(per_row)),
                                   out_specs=qkv, check_vma=False)
    # Mosaic rejects bf16 matmuls at "highest" precision (a global setting some users and our tests choose); for
    # bf16 operands the MXU's products are exact at any precision, so the kernel keeps the default.
    exact = jax.default_matmul_precision("default") if q.dtype == jnp.bfloat16 else contextlib.nullcontext()
    with exact:
        out = per_device(q, k, v, *per_row)  # [B, KVH, G, Tp, Dh]
    return out[:, :, :, pad_q:].transpose(0, 3, 1, 2, 4).reshape(B, T, H, Dh)


def _splits_evenly(rows: int, kv_heads: int) -> bool:
    """Whether the context mesh (if any) splits the rows over all its batch axes and the kv heads over tensor."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return True
    wanted = [(BATCH_AXES, rows), (("tensor",), kv_heads)]
    return all(dividing_axes(mesh, names, size) == (tuple(n for n in names if n in mesh.axis_names) or None)
               for names, size in wanted)


def _block_sizes():
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    b = _SPLASH_BLOCK
    return sk.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b,
                         block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b)


def _splash_kernel(group: int, q_len: int, kv_len: int, interpret: bool):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    mask = sm.MultiHeadMask([sm.CausalMask((q_len, kv_len), offset=kv_len - q_len)] * group)
    # Made inside the caller's trace (its mask tables become that program's constants), never cached across traces.
    return sk.make_splash_mqa_single_device(mask, block_sizes=_block_sizes(), interpret=interpret)


def _masked_splash_kernel(mask: jax.Array, interpret: bool):
    """The kernel for one row's mask [1, Tq, Sk] (bool, traced; one head: the kernel reads it for every head)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    kernel = sk.make_splash_mqa_single_device(mask, block_sizes=_block_sizes(), interpret=interpret)
    # jax 0.10.2 stores the MaskInfo's `is_dynamic_mask` flag through `jnp.array`, which under jit is a tracer, and
    # the kernel's `if` on it then fails: set it back to the Python bool it is.
    for name in ("fwd_mask_info", "dq_mask_info", "dkv_mask_info"):
        info = getattr(kernel, name)
        if info is not None and hasattr(info, "is_dynamic_mask"):
            setattr(kernel, name, info._replace(is_dynamic_mask=True))
    return kernel


__all__ = ["AUTO", "IMPLEMENTATIONS", "causal_attention", "dense_attention", "masked_attention", "mesh_context",
           "resolve_attention", "slot_mask"]
