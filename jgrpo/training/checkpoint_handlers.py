"""The Orbax handler the checkpoint's array items are written with (`jgrpo.training.checkpoint`): Orbax's standard
one, with compression as a choice and small replicated arrays written whole by one replica.
"""

from __future__ import annotations

import jax
import orbax.checkpoint as ocp

# Orbax splits the saving of a replicated array over its replicas ("replica-parallel"), each slicing its part on
# its device: one compiled slice program per shape and sharding. Below this many bytes per replica an array is
# written whole by one replica instead: a tiny GRPO run's first save compiled 136 such programs (3.8 s of a 6.3 s
# save on CPU, tests/training/test_moe_training.py's config), for arrays of a few KB each. Large arrays, where
# parallel writes pay, are still split.
REPLICA_SLICE_MIN_BYTES = 1 << 20


def _type_handlers():
    """Orbax's standard type handlers, with `REPLICA_SLICE_MIN_BYTES` for jax arrays."""
    standard = ocp.type_handlers.get_type_handler(jax.Array)
    arrays = ocp.type_handlers.ArrayHandler(array_metadata_store=standard._array_metadata_store,
                                            min_slice_bytes_for_replica_parallel=REPLICA_SLICE_MIN_BYTES)
    return ocp.type_handlers.create_type_handler_registry(*(
        (ty, arrays if ty is jax.Array else ocp.type_handlers.get_type_handler(ty))
        for ty in ocp.type_handlers.supported_types()))


class ArrayHandler(ocp.StandardCheckpointHandler):
    """Orbax's standard handler with compression as a choice (`checkpoint.compress`); reads either kind."""

    def __init__(self, use_compression: bool, multiprocessing_options: ocp.options.MultiprocessingOptions):
        super().__init__(multiprocessing_options=multiprocessing_options)
        self._impl = ocp.PyTreeCheckpointHandler(use_compression=use_compression,
                                                 type_handler_registry=_type_handlers(),
                                                 multiprocessing_options=multiprocessing_options)
