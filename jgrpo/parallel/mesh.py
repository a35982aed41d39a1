"""The device mesh and the logical-axis -> mesh-axis rules.

Every parameter and activation names its dimensions with *logical* axes ("embed", "mlp",
"heads", "batch", ...). A rules table maps each logical axis to zero or more mesh axes of the
one mesh `(data, fsdp, expert, tensor)`. Training and sampling use different tables: training shards
weights over fsdp (ZeRO-3 style) and tensor; sampling keeps weights whole along fsdp so the
decode loop never all-gathers them at every token.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jgrpo.config import ConfigError, MeshConfig

MESH_AXES = ("data", "fsdp", "expert", "tensor")
# The axes rows (prompts, completions, tokens) are split over: data parallelism, FSDP and, outside the experts'
# matmuls, the expert axis.
BATCH_AXES = ("data", "fsdp", "expert")

# logical axis -> mesh axis (or tuple of mesh axes, or None = replicated)
Rules = Mapping[str, str | tuple[str, ...] | None]

TRAIN_RULES: Rules = {
    "batch": BATCH_AXES,
    "length": None,
    "vocab": "tensor",
    "embed": "fsdp",
    "mlp": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "layers": None,
    "norm": None,
    "lora_rank": None,  # LoRA adapters (models/lora.py): the rank axis is small, replicated
    "experts": "expert",  # MoE experts (models/moe.py, models/expert_parallel.py): E / mesh.expert per device
    "expert_mlp": "tensor",  # an expert's hidden units, sharded as a dense MLP's
    # The router's E outputs stay whole on every device: the top-k reads all E logits of a token, and split over
    # the expert axis the router was all-gathered in every layer of every decode step (13 GB per v5p chip over a
    # 30B-A3B sampling iteration) for a [D, E] matrix of ~0.5 MB.
    "router_logits": None,
}

SAMPLE_RULES: Rules = {
    **TRAIN_RULES,
    "embed": None,  # weights whole along fsdp: no per-token all-gather while decoding
}


def mesh_shape(config: MeshConfig, num_devices: int) -> tuple[int, ...]:
    """Resolve the axis sizes (one may be -1), in MESH_AXES order, for `num_devices`, or fail naming the problem."""
    sizes = [getattr(config, axis) for axis in MESH_AXES]
    named = " x ".join(f"mesh.{axis}={size}" for axis, size in zip(MESH_AXES, sizes, strict=True))
    fix = "set the axis sizes so they multiply to the device count, or one of them to -1 (all remaining devices)"
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if num_devices % known:
            raise ConfigError(f"{named}: the fixed axes use {known} devices, which does not divide the "
                              f"{num_devices} available; {fix}")
        sizes[sizes.index(-1)] = num_devices // known
    if math.prod(sizes) != num_devices:
        raise ConfigError(f"{named} needs {math.prod(sizes)} devices but {num_devices} are available; {fix}")
    return tuple(sizes)


def make_mesh(config: MeshConfig, devices: list | None = None) -> Mesh:
    """A Mesh with axes (data, fsdp, expert, tensor) over `devices` (default: all devices, all processes)."""
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(config, len(devices))
    try:  # topology-aware placement on TPU/GPU; falls back to plain order elsewhere
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_device_mesh(shape, devices=devices)
    except Exception:  # noqa: BLE001 - e.g. CPU devices or a device subset the helper can't lay out
        grid = np.asarray(devices).reshape(shape)
    return Mesh(grid, MESH_AXES)


def make_meshes(config: MeshConfig) -> tuple[Mesh, Mesh]:
    """(the trainer's mesh, the sampler's mesh): one mesh over every device when `mesh.rollout_devices` is 0,
    else the first rollout_devices devices for the sampler and the rest for the trainer (disaggregated). With
    several processes the sampler gets the last ones (whole processes, `check_process_split`): process 0 stays
    the trainer's, which writes the run's files and checkpoints (`training.checkpoint_split`)."""
    n = config.rollout_devices
    if not n:
        mesh = make_mesh(config)
        return mesh, mesh
    devices = jax.devices()
    if n >= len(devices):
        raise ConfigError(f"mesh.rollout_devices={n} leaves no device for the trainer ({len(devices)} devices)")
    sampler, trainer = devices[:n], devices[n:]
    if jax.process_count() > 1:
        check_process_split(n, jax.local_device_count(), len(devices))
        devices = sorted(devices, key=lambda d: (d.process_index, d.id))
        sampler, trainer = devices[-n:], devices[:-n]
    try:
        return make_mesh(config, trainer), make_mesh(config, sampler)
    except ConfigError as e:
        raise ConfigError(f"mesh.rollout_devices={n} splits {len(devices)} devices into {n} for the sampler and "
                         f"{len(devices) - n} for the trainer: {e}") from None


def check_process_split(rollout_devices: int, per_process: int, total: int) -> None:
    """With several processes the sampler gets whole processes (the last ones), and the trainer's devices a
    multiple of the sampler's: the weights cross from one to the other as equal shardings
    (`weights.process_crossing`)."""
    n = rollout_devices
    if n % per_process:
        raise ConfigError(f"mesh.rollout_devices={n} is not a multiple of the {per_process} devices per process: with "
                          "several processes the sampler gets whole processes")
    if n < total and (total - n) % n:
        raise ConfigError(f"mesh.rollout_devices={n} leaves {total - n} devices for the trainer, not a multiple of "
                          f"the sampler's {n}: with several processes the weights cross as equal shardings")


def mesh_platform(mesh: Mesh) -> str:
    """The platform of the mesh's devices ("cpu", "tpu", "gpu"; a deviceless TPU topology is "tpu")."""
    return mesh.devices.flat[0].platform


def logical_to_spec(
    logical: PartitionSpec | tuple | None, rules: Rules, shape: tuple[int, ...] | None = None, mesh: Mesh | None = None
) -> PartitionSpec:
    """Map logical axis names to a mesh PartitionSpec.

    With `shape` and `mesh`, a dimension whose size is not divisible by its mesh axes is left
    replicated instead (e.g. 3 KV heads on a tensor axis of 2): correct, just less sharded.
    A mesh axis is used at most once per spec, first come first served.
    """
    if logical is None:
        return PartitionSpec()
    used: set[str] = set()
    out = []
    for dim, name in enumerate(tuple(logical)):
        if name is None:
            out.append(None)
            continue
        if name not in rules:
            raise KeyError(f"logical axis '{name}' has no rule; known: {sorted(rules)}")
        target = rules[name]
        axes = (target,) if isinstance(target, str) else tuple(target or ())
        axes = tuple(a for a in axes if a not in used)
        if shape is not None and mesh is not None and axes:
            if shape[dim] % math.prod(mesh.shape[a] for a in axes):
                axes = ()
        used.update(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*out)


def _is_spec(x) -> bool:
    return x is None or isinstance(x, PartitionSpec)


def logical_shardings(logical_tree, mesh: Mesh, rules: Rules, shapes=None):
    """Pytree of logical PartitionSpecs (and optionally matching shapes) -> pytree of NamedShardings."""
    if shapes is None:
        return jax.tree.map(lambda s: NamedSharding(mesh, logical_to_spec(s, rules)), logical_tree, is_leaf=_is_spec)
    return jax.tree.map(
        lambda s, x: NamedSharding(mesh, logical_to_spec(s, rules, tuple(np.shape(x)), mesh)),
        logical_tree,
        shapes,
        is_leaf=_is_spec,
    )


def place(tree, logical_tree, mesh: Mesh, rules: Rules):
    """Put every leaf of `tree` on the mesh with the sharding its logical axes ask for."""
    shardings = logical_shardings(logical_tree, mesh, rules, shapes=tree)
    return jax.device_put(tree, shardings)


def context_platform() -> str:
    """The platform of the context mesh's devices while tracing (`jax.set_mesh`; a deviceless TPU topology is
    "tpu"), or of the default device without one: whether a Pallas TPU kernel compiles or runs interpreted."""
    mesh = jax.sharding.get_abstract_mesh()
    return jax.devices()[0].platform if mesh.empty else mesh.abstract_device.platform


def dividing_axes(mesh, names: tuple[str, ...], size: int) -> tuple[str, ...] | None:
    """The longest prefix of the mesh axes `names` whose product divides `size` (None: replicated)."""
    chosen, product = [], 1
    for name in names:
        if name in mesh.axis_names and size % (product * mesh.shape[name]) == 0:
            chosen.append(name)
            product *= mesh.shape[name]
        else:
            break
    return tuple(chosen) or None


def row_sharding(mesh: Mesh, rules: Rules, shape: tuple[int, ...], row_axis: int = 0) -> NamedSharding:
    """Rows (axis `row_axis`) over the batch axes (data x fsdp x expert) when they divide the row count; the rest
    replicated.

    The one place that says how a row-batched array (prompts, completions, rewards, chunks of rows) is laid out.
    """
    logical = [None] * len(shape)
    logical[row_axis] = "batch"
    return NamedSharding(mesh, logical_to_spec(tuple(logical), rules, tuple(shape), mesh))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def replicated_key(seed: int, mesh: Mesh) -> jax.Array:
    """A PRNG key replicated on the mesh, made by a jit: with several processes a key that lives on one
    local device cannot enter a program that spans the mesh."""
    return jax.jit(lambda: jax.random.key(seed), out_shardings=replicated(mesh))()
