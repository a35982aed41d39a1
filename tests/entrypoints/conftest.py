"""The environment of the entrypoint tests' training processes."""

import os

import pytest

from tests.helpers import ROOT, child_xla_flags


@pytest.fixture(scope="module")
def env():
    env = dict(os.environ)
    env.update(
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=child_xla_flags(8),
        PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
        # JAX_COMPILATION_CACHE_DIR: the suite's (tests/conftest.py), inherited: only the first process compiles.
    )
    return env
