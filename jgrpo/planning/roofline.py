"""How fast can an iteration go at best on a TPU chip: a roofline from a plan's per-program costs.

A program cannot run faster than its matmul FLOPs at the chip's peak rate, nor than its HBM traffic at the
chip's bandwidth, nor than the bytes its collectives send at the chip's interconnect (ICI) bandwidth: its
roofline time is the largest of the three (`hlo_cost` and `hlo_inspect` count them from the compiled TPU
HLO, loops included; the ICI term treats the chip's links as one pipe, a simplification of the torus).
The iteration's lower bound is the sum over its programs, each times it runs per iteration. Model FLOPs are
the work the model itself needs (2 x matmul params per token forward, 3 forwards' worth to train, plus
attention, PaLM's convention), independent of remat and of padding; MFU = model FLOPs / (peak x roofline
time) is therefore the best MFU this plan allows, an upper bound for the real run.
"""

from __future__ import annotations

import dataclasses

from jgrpo.models.layer_stack import moe_layer_count


@dataclasses.dataclass(frozen=True)
class Chip:
    hbm_gib: float  # HBM per chip
    bf16_tflops: float  # peak dense bf16 TFLOP/s per chip
    hbm_gbps: float  # HBM bandwidth per chip, GB/s
    ici_gbps: float  # interchip interconnect bandwidth per chip, GB/s
    # Data-center network (between slices: two jobs' weights and records) per chip, GB/s; None: not published.
    dcn_gbps: float | None = None


# Published per-chip figures (Google Cloud TPU documentation, "TPU versions": the v4, v5e, v5p and v6e pages;
# ICI 2400, 1600, 4800 and 3584 Gbps; DCN: v5p 50 Gbps per chip, v5e 2 x 100 Gbps per 8-chip host).
CHIPS = {
    "v4": Chip(hbm_gib=32, bf16_tflops=275, hbm_gbps=1228, ici_gbps=300),
    "v5e": Chip(hbm_gib=16, bf16_tflops=197, hbm_gbps=819, ici_gbps=200, dcn_gbps=200 / 8 / 8),
    "v5p": Chip(hbm_gib=95, bf16_tflops=459, hbm_gbps=2765, ici_gbps=600, dcn_gbps=50 / 8),
    "v6e": Chip(hbm_gib=32, bf16_tflops=918, hbm_gbps=1640, ici_gbps=448),
}


@dataclasses.dataclass(frozen=True)
class HostCopies:
    """What one host moves per second (GB/s) on the weights' way between two jobs: device to host, over one TCP
    connection to the peer host, host to device."""

    d2h_gbps: float
    tcp_gbps: float
    h2d_gbps: float


# The one published measurement of a TPU host's weight sync (Raiden, verl #7905/#7982: v6e, per host, 1.5 GB). Used
# for every TPU generation: none publishes its own (an assumption; PCIe-attached chips alike).
TPU_HOST = HostCopies(d2h_gbps=11.5, tcp_gbps=3.6, h2d_gbps=16.4)


def weight_sync_seconds(nbytes: float, *, dcn_gbps: float, bucket_bytes: float, host: HostCopies = TPU_HOST,
                        channel_efficiency: float = 1.0) -> dict[str, float]:
    """Seconds to move `nbytes` from a trainer host to a rollout host, pipelined in buckets (jgrpo's
    `parallel/weights/send.py`: bucket k + 1 off the devices while k crosses and k - 1 lands): the slowest stage
    sets the pace, and one bucket fills and drains the pipeline. The link is the host's data-center bandwidth
    (`dcn_gbps`) or one TCP connection's, whichever is lower, times the share of it jgrpo's channel reaches
    (`channel_efficiency`: ours_over_raw, benchmarks/weight_sync.py)."""
    link = min(dcn_gbps, host.tcp_gbps) * channel_efficiency
    rates = {"d2h": host.d2h_gbps, "link": link, "h2d": host.h2d_gbps}
    pace = min(rates.values())
    bucket = min(bucket_bytes, nbytes)
    total = nbytes / (pace * 1e9) + bucket / (host.d2h_gbps * 1e9) + bucket / (host.h2d_gbps * 1e9)
    return {"seconds": total, "bound_by": min(rates, key=rates.get), "link_gbps": link,
            "serial_seconds": sum(nbytes / (r * 1e9) for r in rates.values())}


def bounds(flops: float, hbm_bytes: float, ici_bytes: float, chip: Chip) -> dict[str, float]:
    """Seconds one program needs at best on one chip for its compute, its HBM traffic and its collectives."""
    return {"compute": flops / (chip.bf16_tflops * 1e12), "memory": hbm_bytes / (chip.hbm_gbps * 1e9),
            "interconnect": ici_bytes / (chip.ici_gbps * 1e9)}


def matmul_params(cfg) -> int:
    """Parameters that take part in a matmul per token: every layer's projections and the unembedding (the
    embedding lookup is a gather, not a matmul). A mixture of experts counts its router and the k experts a token
    is routed to, not the E it holds (MFU on active parameters); a periodic stack's dense layers their MLP."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    moe_layers = moe_layer_count(cfg)
    moe = cfg.hidden_size * cfg.num_experts + cfg.experts_per_token * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    mlp = moe_layers * moe + (cfg.num_layers - moe_layers) * 3 * cfg.hidden_size * cfg.intermediate_size
    attention = cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size
    return cfg.num_layers * attention + mlp + cfg.vocab_size * cfg.hidden_size


def forward_flops(cfg, tokens: float, context: float) -> float:
    """Model FLOPs of a forward pass over `tokens` tokens that each attend to `context` positions."""
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context  # q.k and p.v per token
    return tokens * (2 * matmul_params(cfg) + attention)


def iteration_model_flops(cfg, *, prompts: int, samples: int, prompt_len: int, new_tokens: int,
                          train_passes: float, forward_passes: int) -> dict[str, float]:
    """Model FLOPs of one iteration (whole slice): sampling (each prompt prefilled once, every completion
    decoded to full length) and training (`train_passes` forward+backward passes over the batch, plus
    `forward_passes` forward-only passes: reference and lp_k). Each prompt counts once per group."""
    rows = prompts * samples
    sample = (forward_flops(cfg, prompts * prompt_len, prompt_len)
              + forward_flops(cfg, rows * new_tokens, prompt_len + new_tokens / 2))
    one_pass = forward_flops(cfg, prompts * prompt_len + rows * new_tokens, prompt_len + new_tokens)
    return {"sample": sample, "train": (3 * train_passes + forward_passes) * one_pass,
            "update": 3 * train_passes * one_pass}


def roofline(plan: dict, chip: Chip) -> dict:
    """Per-program roofline seconds and the iteration's lower bound, tokens/s per chip and best-case MFU."""
    chips = plan["chips"]
    limits = {p["name"]: bounds(p["flops"], p["hbm_bytes"], p["loops"].get("collective_bytes", 0.0), chip)
              for p in plan["programs"]}
    seconds = {name: max(b.values()) for name, b in limits.items()}
    per_iteration = {p["name"]: p["runs"] * seconds[p["name"]] for p in plan["programs"] if p["name"] != "eval"}
    sample_s = per_iteration.get("sample", 0.0)
    train_s = sum(v for k, v in per_iteration.items() if k != "sample")
    iteration_s = sample_s + train_s
    model = plan["model_flops"]
    tokens = plan["tokens"]
    return {
        "program_s": seconds,
        "iteration_s": iteration_s,
        "sample_s": sample_s,
        "train_s": train_s,
        "sample_tokens_per_s_per_chip": tokens["sampled"] / chips / sample_s if sample_s else 0.0,
        "train_tokens_per_s_per_chip": tokens["trained"] / chips / train_s if train_s else 0.0,
        "mfu": (model["sample"] + model["train"]) / chips / (chip.bf16_tflops * 1e12 * iteration_s),
        # The training step alone: the updates' model FLOPs over their roofline time.
        "update_mfu": (model["update"] / chips / (chip.bf16_tflops * 1e12 * per_iteration["update"])
                       if per_iteration.get("update") else 0.0),
        "bound": {name: max(b, key=b.get) for name, b in limits.items()},
    }
