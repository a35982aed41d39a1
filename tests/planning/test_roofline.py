"""The roofline of a plan, by hand: each program's slowest resource, the iteration's sum, the MFU bounds, and the
weights' trip between two jobs."""

import pytest

from jgrpo.planning.roofline import Chip, roofline, weight_sync_seconds

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


def test_weights_between_jobs_go_at_the_pace_of_their_slowest_stage_plus_one_bucket():
    # DeepScaleR's 3.55 GB of bf16 into a v5p host (4 chips x 50 Gbps = 25 GB/s of DCN): one TCP connection (3.6
    # GB/s, Raiden's measurement) is the slowest stage, not the DCN; a 512 MiB bucket fills (D2H at 11.5 GB/s) and
    # drains (H2D at 16.4 GB/s) the pipeline once. Serially the three stages would add up.
    bucket = 512 << 20
    sync = weight_sync_seconds(3.55e9, dcn_gbps=25.0, bucket_bytes=bucket)
    assert sync["bound_by"] == "link" and sync["link_gbps"] == 3.6
    assert sync["seconds"] == pytest.approx(3.55 / 3.6 + bucket / 11.5e9 + bucket / 16.4e9)
    assert sync["serial_seconds"] == pytest.approx(3.55 / 11.5 + 3.55 / 3.6 + 3.55 / 16.4)
    # The channel at 80% of the link, and a link slower than TCP (v5e: 2 x 100 Gbps per 8 chips = 25 GB/s per host,
    # here a host of 1 chip: 3.125 GB/s): the slower of the two, then the share.
    assert weight_sync_seconds(1e9, dcn_gbps=3.125, bucket_bytes=bucket, channel_efficiency=0.8)["link_gbps"] == \
        pytest.approx(2.5)
    # Fewer bytes than a bucket: the bucket is the bytes.
    assert weight_sync_seconds(1e6, dcn_gbps=25.0, bucket_bytes=bucket)["seconds"] == pytest.approx(
        1e6 / 3.6e9 + 1e6 / 11.5e9 + 1e6 / 16.4e9)
