"""Weights within one job: a copy of the params in the sampler's dtype and layout, on the same devices or on a
sub-mesh (`mesh.rollout_devices`), whose processes may be the same (a `device_put`) or others (`ProcessCrossing`).

What samples is always a copy, never the trained params forwarded: the train step donates those.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh

from jgrpo.parallel.weights.process_crossing import ProcessCrossing


def param_copier(shardings, convert=None, *, source: Mesh | None = None):
    """A jitted copy of a param pytree onto `shardings` (None: where it is), through `convert` (params -> params,
    e.g. the sampler's cast or int8 quantization, `models.quantize.sampler_copy`; None: as they are).

    Always new buffers, never the inputs forwarded, so a copy (behaviour, reference, sampling weights)
    survives the train step's donation of the current params. `source`: the params' mesh, when `shardings` lie on
    another sub-mesh (`make_meshes`): convert where the params are, then one transfer (a jit cannot span both) of
    the converted bytes (int8: a quarter of float32's).
    """
    convert = convert or (lambda params: params)
    if source is None:
        return jax.jit(lambda params: jax.tree.map(jax.numpy.copy, convert(params)), out_shardings=shardings)
    target = jax.tree.leaves(shardings)[0].mesh
    if _processes(source) == _processes(target):
        convert_all = jax.jit(convert)
        return lambda params: jax.device_put(convert_all(params), shardings)
    return ProcessCrossing(shardings, lambda on: param_copier(on, convert), source, target)


# One array's copy on the device that holds it, always new buffers: the rollout job's spares, into which the next
# changes are written beside the version that samples (`changes.Spares`).
copy_on_its_device = jax.jit(jax.numpy.copy)


def param_mover(shardings, source: Mesh):
    """The params (from `source`'s devices) onto `shardings` as they are: a `device_put`, or with the two meshes on
    other processes the crossing of `param_copier`."""
    target = jax.tree.leaves(shardings)[0].mesh
    if _processes(source) == _processes(target):
        return lambda params: jax.device_put(params, shardings)
    return param_copier(shardings, source=source)


def _processes(mesh: Mesh) -> set[int]:
    return {d.process_index for d in mesh.devices.flat}
