"""Start JAX's multi-controller runtime (one process per host) before anything touches a device.

Every process of a multi-host run executes the same program; `initialize()` joins them into one runtime so
`jax.devices()` lists the devices of all hosts and one mesh spans them. Where the settings come from:

    Cloud TPU VM or pod slice   nothing to set: jax.distributed.initialize() reads the slice from the TPU
                                metadata (a single-host slice simply becomes a runtime of one process)
    anywhere else               JGRPO_COORDINATOR=host:port  JGRPO_NUM_PROCESSES=N  JGRPO_PROCESS_ID=i
                                in each process (the coordinator is process 0's host; any free port)
    one process                 nothing at all: no runtime is started

On CPU the processes exchange collectives over gloo (TCP), e.g. several processes on one machine.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import jax

from jgrpo.config.errors import ConfigError

log = logging.getLogger(__name__)

ENV_COORDINATOR = "JGRPO_COORDINATOR"
ENV_NUM_PROCESSES = "JGRPO_NUM_PROCESSES"
ENV_PROCESS_ID = "JGRPO_PROCESS_ID"


def settings_from_env(environ: Mapping[str, str] | None = None) -> tuple[str, int, int] | None:
    """(coordinator address, process count, process id) from the JGRPO_* variables; None when unset."""
    environ = os.environ if environ is None else environ
    names = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)
    given = {name: environ.get(name, "").strip() for name in names}
    if not any(given.values()):
        return None
    missing = [name for name in names if not given[name]]
    if missing:
        raise ConfigError(f"multi-process run: {', '.join(missing)} not set (set all of {', '.join(names)})")
    coordinator = given[ENV_COORDINATOR]
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"{ENV_COORDINATOR}={coordinator!r} is not host:port (e.g. 10.0.0.2:8476)")
    try:
        count, index = int(given[ENV_NUM_PROCESSES]), int(given[ENV_PROCESS_ID])
    except ValueError:
        raise ConfigError(f"{ENV_NUM_PROCESSES}={given[ENV_NUM_PROCESSES]!r} and {ENV_PROCESS_ID}="
                         f"{given[ENV_PROCESS_ID]!r} must be integers") from None
    if count < 1 or not 0 <= index < count:
        raise ConfigError(f"{ENV_PROCESS_ID}={index} must be in [0, {ENV_NUM_PROCESSES}={count})")
    return coordinator, count, index


def on_cloud_tpu() -> bool:
    """True on a Cloud TPU VM with libtpu (JAX decides this when it is imported, from the TPU chips present)."""
    from jax._src import cloud_tpu_init  # no public flag; the same one jax.distributed's TPU detection uses

    return bool(getattr(cloud_tpu_init, "running_in_cloud_tpu_vm", False))


def initialize(environ: Mapping[str, str] | None = None) -> int:
    """Join the multi-process runtime when this process is one of several; returns the process count.

    Call once, first thing, before any computation (the devices of the other hosts cannot be added to a
    backend that already started). Safe to call again.
    """
    if jax.distributed.is_initialized():
        return jax.process_count()
    settings = settings_from_env(environ)
    if settings is not None:
        coordinator, count, index = settings
        if count == 1:
            return 1
        # CPU collectives across processes need an implementation; TPU/GPU ignore this setting.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=count, process_id=index)
    elif on_cloud_tpu():
        jax.distributed.initialize()
    else:
        return 1
    log.info("process %d of %d; %d local of %d devices", jax.process_index(), jax.process_count(),
             jax.local_device_count(), jax.device_count())
    return jax.process_count()
