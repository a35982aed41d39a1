"""What this machine can do: the figures benchmarks divide by (shared by every script here)."""

import os
import time


def usable_cores() -> int:
    """CPU cores this process may run on (`taskset` narrows it; os.cpu_count() would not see that)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def matmul_peak_flops(dtype: str = "float32", size: int = 2048, repeats: int = 5) -> float:
    """Best-of-`repeats` FLOP/s of a jitted square matmul: this machine's practical peak.

    The best, not the mean, because other load on a shared machine only ever lowers it.
    """
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (size, size), jnp.dtype(dtype))
    matmul = jax.jit(lambda x: x @ x)
    matmul(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best
