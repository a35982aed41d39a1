"""Weights from the trainer's processes to the sampler's, inside one job (`mesh.rollout_devices` across processes).

A jit spans one mesh, and JAX moves an array between processes only as equal shardings (`jax.device_put`
across hosts: on CPU it hung on the second 12.6 MB transfer, jax 0.10.2). So the two sides meet on a "bridge"
mesh of both, in one collective:

    trainer's devices, as (copies, *sampler's shape)   copy 0 | copy 1 | ...    the "twin": the sampler's layout,
    + the sampler's devices as one more copy            ... | sampler          replicated over "copies"
    collective-permute over "copies": copy 0's shards -> the sampler's devices, each to the device of that shard

The backend's own collectives carry it (ICI or DCN on TPU, NCCL on GPU, gloo on CPU). The sampler's side enters
zeros, donated where the twin may go too, so the weights it receives take their buffers. The twin lives on the
trainer's processes: a behaviour copy kept there is what they checkpoint (`training.checkpoint_split`), and it
crosses when it samples.
Needs the trainer's devices a multiple of the sampler's (`mesh.check_process_split`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding


class ProcessCrossing:
    """Copy the params on the trainer's devices into the twin of `shardings` (`twin`), then `send` it to the
    sampler's devices (`target`); calling it does both. Every process calls it, in the same order. `copier`:
    (shardings) -> a jitted copy of the params onto them through the sampler's conversion (`mesh.param_copier`)."""

    def __init__(self, shardings, copier, source: Mesh, target: Mesh):
        devices = list(source.devices.flat)
        copies, rest = divmod(len(devices), target.devices.size)
        if rest:
            raise ValueError(f"{len(devices)} trainer devices are not a multiple of the sampler's "
                             f"{target.devices.size}")
        wide = Mesh(np.asarray(devices).reshape((copies,) + target.devices.shape), ("copies",) + target.axis_names)
        bridge = Mesh(np.concatenate([wide.devices, target.devices[None]]), wide.axis_names)
        specs = jax.tree.map(lambda s: s.spec, shardings)
        self.shardings = shardings
        self.twin_shardings = jax.tree.map(lambda s: NamedSharding(wide, s.spec), shardings)
        self._on_bridge = jax.tree.map(lambda s: NamedSharding(bridge, s.spec), shardings)
        self.twin = copier(self.twin_shardings)
        # check_vma off: the values are "replicated" over copies in name only (real on copy 0, zeros on the sampler).
        permute = jax.shard_map(
            lambda tree: jax.tree.map(lambda a: jax.lax.ppermute(a, "copies", [(0, copies)]), tree),
            mesh=bridge, in_specs=(specs,), out_specs=specs, check_vma=False)
        # Donating frees the zeros for the received weights, and the twin too: only for a twin nobody keeps.
        self._permute = {False: jax.jit(permute), True: jax.jit(permute, donate_argnums=0)}
        self._sampler_devices = set(target.devices.flat)
        self._zeros = None

    def __call__(self, params):
        return self.send(self.twin(params), consume=True)

    def send(self, twin, consume: bool = False):
        """The twin's values on the sampler's devices, laid out as `shardings`; `consume`: the twin's buffers go."""
        if self._zeros is None:
            shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), twin)
            self._zeros = jax.jit(lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes),
                                  out_shardings=self.shardings)
        bridged = jax.tree.map(_joined, twin, self._zeros(), self._on_bridge)
        return jax.tree.map(self._received, self._permute[consume](bridged), self.shardings)

    def _received(self, x, sharding):
        shards = [s.data for s in x.addressable_shards if s.device in self._sampler_devices]
        return jax.make_array_from_single_device_arrays(x.shape, sharding, shards, dtype=x.dtype)


def _joined(twin, zeros, sharding):
    """One array over the bridge from the twin's shards (trainer) and the zeros' (sampler): what this process holds."""
    shards = {s.device: s.data for s in twin.addressable_shards}
    shards.update({s.device: s.data for s in zeros.addressable_shards})
    return jax.make_array_from_single_device_arrays(
        twin.shape, sharding, [shards[d] for d in sharding.addressable_devices], dtype=twin.dtype)
