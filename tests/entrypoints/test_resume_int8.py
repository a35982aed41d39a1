"""A run sampling from an int8 copy (weights and KV cache) at v = 4, killed with SIGKILL after its checkpoint at
iteration 3 and resumed, ends bit-for-bit equal to the uninterrupted run: the behaviour copy (int8 values and
scales) comes back from the checkpoint as it was (its own module: a worker of its own under xdist)."""

import pytest

from tests.entrypoints.runs import finish, killed_then_resumed, train

INT8 = ("sampler.weights_dtype=int8", "sampler.kv_cache_dtype=int8", "grpo.masked_is=token")


@pytest.fixture(scope="module")
def straight_int8_run(tmp_path_factory, env):
    run_dir = tmp_path_factory.mktemp("straight_int8")
    code, out = finish(train(run_dir, env, *INT8))
    assert code == 0, out[-3000:]
    return run_dir


def test_killed_then_resumed_equals_uninterrupted_with_an_int8_sampler(tmp_path, env, straight_int8_run):
    killed_then_resumed(tmp_path, env, straight_int8_run, *INT8)
