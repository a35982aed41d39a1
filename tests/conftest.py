"""Tests run on a CPU-emulated 8-device mesh; the flag must be set before jax is imported.

One persistent XLA compilation cache serves the whole run: the xdist workers and the `python -m jgrpo.*`
processes tests start (they inherit the variable) compile many of the same programs (the tiny config's sampler
and steps, test after test). Compiling is ~60% of the suite's CPU time; measured on the 2-core machine, the
shared cache hit ~900 of ~1,700 cacheable compiles and saved ~450 s of compiling (2387 -> 2117 s for the suite).
A cache hit still counts as a compile for tests/training/test_recompile.py (jax reports both as a backend compile).
The directory is made here (in the xdist controller, before the workers start) and removed when the run ends.
"""

import gc
import os
import platform
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=8"
# The tests' programs are tiny and compiling them is most of the suite's time: XLA:CPU's LLVM passes off saves ~30%
# of a compile-bound test (tests/training/test_moe_training.py's LoRA test: 28 s against 41). Results move by float
# rounding only: the golden run, recorded at the default level, still matches (docs/testing.md).
if "xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=0"
# XLA:CPU compiles for the processor it runs on, and code with fused multiply-adds (AVX2's FMA, AVX-512) rounds
# otherwise: on an AVX-512 machine of this project's (2026-12-07) the golden run's sync_v4_recentred_m2po mode drew
# another token at its 4th update and two learning tests (tests/training/test_trainer_learning.py) missed their
# thresholds, where code for AVX (or SSE4.2) on the same machine reproduced the recording in all 6 modes and passed.
# On x86 the tests' code is for AVX at most, so that what was recorded holds on every machine kind CI may draw (the
# golden recorders, scripts/compare_with_commit.py's CPU_ISA_FLAG, compile so too).
_ISA = "--xla_cpu_max_isa=AVX" if platform.machine().lower() in ("x86_64", "amd64") else ""
if "xla_cpu_max_isa" not in _flags:
    _flags += f" {_ISA}"
os.environ["XLA_FLAGS"] = _flags.strip()

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ["JGRPO_TEST_XLA_CACHE"] = tempfile.mkdtemp(prefix="jgrpo-xla-")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")  # the default (1 s) skips most
    # A size limit turns on the cache's file lock around every read and write. Without it an entry is written in
    # place while another worker may read it: a half-written executable aborts the reading process (seen: a
    # worker killed by "Fatal Python error: Aborted" in compilation_cache.get_executable_and_time when two
    # workers compiled the same tiny MoE programs at once). 8 GiB is far above what a run writes.
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(8 << 30))

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """After each test module, drop jax's in-memory caches of traced and compiled programs. A worker otherwise keeps
    every program of every module it ran (seen: a worker at ~9 GB late in the suite on this 24 GB machine, and two
    runs whose other worker aborted in XLA's compiler near the end); programs a later module needs again come back
    from the persistent cache above."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def devices():
    return jax.devices()


@pytest.fixture(scope="module")
def compile_counter():
    """Counts XLA compilations while `.active` (tests/helpers.py)."""
    from tests.helpers import CompileCounter

    return CompileCounter()


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """(graphdef, params) of the sampler tests' tiny Llama (tests/helpers_models.py), built once per module."""
    from tests.helpers_models import sampler_model

    _, (graphdef, params, _) = sampler_model("llama", tmp_path_factory.mktemp("llama-only"))
    return graphdef, params


def pytest_unconfigure(config):
    # Only the process that made the cache removes it (workers inherit JGRPO_TEST_XLA_CACHE; they have workerinput).
    owned = os.environ.get("JGRPO_TEST_XLA_CACHE")
    if owned and not hasattr(config, "workerinput") and owned == os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        shutil.rmtree(owned, ignore_errors=True)
