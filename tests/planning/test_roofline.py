"""The roofline of a plan, by hand: each program's slowest resource, the iteration's sum, and the MFU bounds."""

import pytest

from jgrpo.planning.roofline import Chip, roofline

CHIP = Chip(hbm_gib=16, bf16_tflops=100, hbm_gbps=1000, ici_gbps=100)


def test_programs_take_their_slowest_resource_and_the_iteration_their_sum():
    plan = {"chips": 2, "tokens": {"sampled": 4000, "trained": 6000},
            "model_flops": {"sample": 2e12, "train": 16e12, "update": 12e12},
            "programs": [  # per chip: sample 0.5 s of HBM; ref 0.2 s of compute; update 0.3 s of ICI, run twice
                {"name": "sample", "flops": 1e12, "hbm_bytes": 500e9, "loops": {}, "runs": 1},
                {"name": "ref_logprobs", "flops": 20e12, "hbm_bytes": 1e9, "loops": {"collective_bytes": 1e9},
                 "runs": 1},
                {"name": "update", "flops": 10e12, "hbm_bytes": 100e9, "loops": {"collective_bytes": 30e9},
                 "runs": 2},
                {"name": "eval", "flops": 1e15, "hbm_bytes": 0, "loops": {}, "runs": 1}]}  # not per iteration
    r = roofline(plan, CHIP)
    assert r["bound"] == {"sample": "memory", "ref_logprobs": "compute", "update": "interconnect",
                          "eval": "compute"}
    assert r["sample_s"] == pytest.approx(0.5) and r["train_s"] == pytest.approx(0.2 + 2 * 0.3)
    assert r["iteration_s"] == pytest.approx(1.3)
    assert r["sample_tokens_per_s_per_chip"] == pytest.approx(4000 / 2 / 0.5)
    assert r["mfu"] == pytest.approx((2e12 + 16e12) / 2 / (100e12 * 1.3))
    # The training step alone: 12e12 model FLOPs of updates, 6e12 per chip, in 0.6 s at 100 TFLOP/s = 10%.
    assert r["update_mfu"] == pytest.approx(0.1)


def test_a_mixture_of_experts_counts_its_routed_experts_only():
    # Qwen3-30B-A3B's shipped shapes: ~3.3B active matmul parameters per token of its ~30.5B (48 layers, 128
    # experts of 768 units, 8 per token, hidden 2048, 32 query and 4 kv heads of 128, vocab 151936, untied head).
    from jgrpo.models.shapes import model_shapes
    from jgrpo.planning.roofline import matmul_params

    cfg = model_shapes("Qwen/Qwen3-30B-A3B")
    assert (cfg.num_layers, cfg.num_experts, cfg.experts_per_token, cfg.moe_intermediate_size) == (48, 128, 8, 768)
    attention = 2048 * (32 * 128 + 2 * 4 * 128) + 32 * 128 * 2048  # q, k, v, o
    routed = 2048 * 128 + 8 * 3 * 2048 * 768  # the router, and 8 SwiGLU experts
    assert matmul_params(cfg) == 48 * (attention + routed) + 151936 * 2048
    assert 3.0e9 < matmul_params(cfg) < 3.5e9
