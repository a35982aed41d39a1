"""`jgrpo.plan`: the trainer's programs compiled for a real TPU topology (deviceless, libtpu's compiler).

Per-chip bytes are checked against arithmetic from the parameter count and the shardings, a broken sharding
rule must show up as per-chip memory, an oversized plan must say it does not fit, and bad input fails by name.
"""

import dataclasses
import json
import math

import pytest

pytest.importorskip("libtpu", reason="the TPU compiler comes with jax[tpu] (bash .ci/install installs it)")

from jgrpo.config import ConfigError  # noqa: E402
from jgrpo.config.loading import load_config  # noqa: E402
from jgrpo.models.shapes import KNOWN_SHAPES, model_shapes  # noqa: E402
from jgrpo.parallel.mesh import TRAIN_RULES  # noqa: E402
from jgrpo.plan import abstract_run, main, per_chip_bytes, plan_iteration, sampler_line, topology_devices  # noqa: E402
from jgrpo.planning.fit import GIB  # noqa: E402
from jgrpo.planning.paged_rows import KVShape, paged_row_tokens, rows_in_flight, step_reads  # noqa: E402

TINY = ["checkpoint.every=0", "logging.tensorboard=false"]


@pytest.fixture(scope="module")
def v5e():
    devices, chip = topology_devices("v5e:2x4")
    assert len(devices) == 8 and chip.hbm_gib == 16
    return devices


def test_per_chip_params_and_optimizer_state_are_the_arithmetic(v5e):
    # SmolLM2-135M from its shipped shape description, FSDP over the 8 chips of a v5e-8. Every weight has a
    # hidden (576 = 8 x 72) dimension that FSDP splits, except the RMSNorm weights, which are replicated:
    # per chip = 4 bytes x (weights / 8 + norms). AdamW keeps two such moments, plus step counters.
    config = load_config("configs/quickstart.yaml", TINY)
    run = abstract_run(config, v5e)
    cfg = run.cfg
    D, F, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    norms = (2 * L + 1) * D
    weights = cfg.vocab_size * D + L * (D * q + 2 * D * kv + q * D + 3 * D * F)
    assert weights + norms == 134_515_008  # SmolLM2-135M's published parameter count
    params = per_chip_bytes(run.params)
    assert params == 4 * (weights // 8 + norms)
    opt = per_chip_bytes(run.opt_state)
    assert 2 * params <= opt <= 2 * params + 64  # mu, nu and a few scalar counters
    # The sampling layout keeps weights whole along fsdp: the full model on every chip; half of it in bf16.
    assert per_chip_bytes(run.sample_params) == 4 * (weights + norms)
    bf16 = abstract_run(load_config("configs/quickstart.yaml", TINY + ["sampler.weights_dtype=bfloat16"]), v5e)
    assert per_chip_bytes(bf16.sample_params) == 2 * (weights + norms)
    assert per_chip_bytes(bf16.params) == params  # the trained (master) weights keep their dtype


def test_plan_of_a_small_run_and_a_broken_sharding_rule(v5e):
    config = load_config("configs/tiny.yaml", TINY + ["grpo.behaviour_refresh=2"])
    plan = plan_iteration(config, v5e)
    names = [p["name"] for p in plan["programs"]]
    assert names == ["sample", "assemble", "ref_logprobs", "update", "behaviour"]
    assert all(p["compile_s"] > 0 and p["argument_bytes"] > 0 for p in plan["programs"])
    sample = plan["programs"][0]
    assert 0 < sample["step_bytes"] < sample["hbm_bytes"] / 4  # one decode step of the 7 the tiny config takes
    assert sum(sample["decode_weight_bytes"].values()) > 0  # the weights it reads (tests/planning/test_hlo_cost.py)
    assert all(not p["decode_weight_bytes"] for p in plan["programs"][1:])  # samplers only
    update = next(p for p in plan["programs"] if p["name"] == "update")
    resident = plan["resident_bytes"]
    # The update reads params, optimiser state and the step batch (plus TPU tiling padding of small dims, ~6% on
    # this 64-wide model), and donates the first two to its outputs.
    logical = resident["params"] + resident["opt_state"] + resident["step_batch"]
    assert logical <= update["argument_bytes"] <= 1.1 * logical
    assert update["alias_bytes"] >= resident["params"] + resident["opt_state"] - 64
    assert plan["peak_bytes"] >= sum(resident.values())

    # The paged cache's line: a step's reads counted from the page tables as the pallas kernel copies them, a
    # part-full page to its live tokens rounded to a tile's rows: the tiny model's float32 cache, 8 rows
    # (tests/planning/test_paged_rows.py).
    s, (_, chip) = plan["sampler"], topology_devices("v5e:2x4")
    assert (s["page_size"], s["attention"], s["kv"]["dtype"]) == (64, "pallas", "float32")
    P, N = s["prompt_width"], s["new_tokens"]
    kv = KVShape(**s["kv"])
    half = rows_in_flight(chip.hbm_gib * GIB - s["without_pool_bytes"], paged_row_tokens(P, (N - 1) / 2, s["group"],
                                                                                         64), kv)
    reads = step_reads(sum(sample["decode_weight_bytes"].values()), kv, [(P, (N - 1) // 2)] * half, page_size=64,
                       prompt_width=P, new_tokens=N, granule=8)
    whole = step_reads(sum(sample["decode_weight_bytes"].values()), kv, [(P, (N - 1) // 2)] * half, page_size=64,
                       prompt_width=P, new_tokens=N)
    line = sampler_line(s, chip, chip.hbm_gib, sample)
    assert f"{half} at half of it" in line and f"({reads.paged_over_live:.2f}x the live minimum)" in line
    assert reads.paged < whole.paged

    # A rule that forgets FSDP (weights replicated on every chip) costs 8x the param and optimiser bytes.
    broken = plan_iteration(config, v5e, train_rules={**TRAIN_RULES, "embed": None})
    ratio = broken["resident_bytes"]["params"] / resident["params"]
    assert 7 < ratio <= 8
    assert broken["peak_bytes"] > plan["peak_bytes"] + 6 * resident["opt_state"]


def test_a_multi_turn_config_is_planned_at_the_episode_width(v5e):
    # configs/tiny_tools.yaml: a row is a whole episode (env.max_total_tokens), not one turn (sampler.max_new_tokens).
    from jgrpo.planning.abstract_run import lower_iteration

    config = load_config("configs/tiny_tools.yaml", TINY)
    iteration = lower_iteration(config, v5e, names=("sample", "assemble", "update"))
    assert iteration.shape["N"] == config.env.max_total_tokens != config.sampler.max_new_tokens
    assert [p.name for p in iteration.programs] == ["sample", "assemble", "update"]
    assemble = iteration.programs[1].lowered.compile()
    assert assemble.memory_analysis().argument_size_in_bytes > 0


def test_bad_input_names_the_problem(v5e):
    with pytest.raises(ValueError, match=r"unknown TPU topology 'v9x:2x2'.*v5e:2x4"):
        topology_devices("v9x:2x2")
    with pytest.raises(ValueError, match=r"cannot describe TPU topology 'v5e:3x7'"):
        topology_devices("v5e:3x7")
    with pytest.raises(ValueError, match=r"needs 3 devices but 8 are available"):
        abstract_run(load_config("configs/tiny.yaml", ["mesh.data=3", "mesh.fsdp=1"]), v5e)
    with pytest.raises(ValueError, match=r"no shape description for model 'org/unknown-7b'.*Qwen2.5-0.5B-Instruct"):
        abstract_run(load_config("configs/tiny.yaml", ["model.name=org/unknown-7b"]), v5e)
    with pytest.raises(ConfigError):
        load_config("configs/tiny.yaml", ["mesh.tensor=0"])


@pytest.mark.parametrize("name", sorted(KNOWN_SHAPES))
def test_shipped_shape_descriptions_have_the_published_sizes(name):
    # Model cards: SmolLM2 134.5M, Qwen2.5-0.5B 0.49B, R1-Distill-1.5B 1.78B, Llama-3.2-1B 1.24B, Qwen3-0.6B
    # 0.6B (0.44B without embeddings), Qwen3-1.7B 1.7B (1.41B without embeddings; tied embeddings counted once),
    # Qwen3-30B-A3B 30.5B, Qwen3-235B-A22B 235B (every expert counted; their active sizes: tests/models/test_moe.py).
    published = {"HuggingFaceTB/SmolLM2-135M-Instruct": 134.5e6, "Qwen/Qwen2.5-0.5B-Instruct": 494.0e6,
                 "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B": 1777.1e6, "meta-llama/Llama-3.2-1B": 1235.8e6,
                 "Qwen/Qwen3-0.6B": 596.0e6, "Qwen/Qwen3-1.7B": 1720.6e6, "Qwen/Qwen3-30B-A3B": 30.5e9,
                 "Qwen/Qwen3-235B-A22B": 235.0e9}
    cfg = model_shapes(name)
    from jgrpo.models.parameters import param_specs

    count = sum(math.prod(spec.shape) for spec in param_specs(cfg).values())
    assert abs(count - published[name]) / published[name] < 2e-3, count
    assert dataclasses.asdict(model_shapes(name.split("/")[-1].upper())) == dataclasses.asdict(cfg)


def test_fit_finds_the_fastest_plan_that_fits(capsys):
    # 4 prompts x 8 samples x 64 new tokens on the tiny model (no reference: fewer programs to compile): the
    # update holds the peak (about 30 MiB per chip with remat none and one micro-batch). In 25 MiB the config
    # as shipped does not fit; 4 micro-batches or remat "dots" do (2 micro-batches is worse than 1: XLA keeps
    # more of the accumulation alive), and a costlier remat is only tried with fewer micro-batches than a
    # cheaper one needed.
    # Overrides anywhere among the flags (before, between, after), as `jgrpo.train` takes them.
    args = ["configs/tiny.yaml", *TINY, "sampler.max_new_tokens=64", "--topology", "v5e:2x4", "grpo.num_generations=8",
            "--hbm-gib", f"{25 / 1024}", "--fit", "grpo.beta=0"]
    assert main(args) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert any("DOES NOT FIT in 0.0244141 GiB" in line for line in out)
    assert any(line.startswith("largest buffers:") and "'update' temporaries" in line for line in out)
    record = json.loads(out[-1])["plans"][0]
    assert record["topology"] == "v5e:2x4" and record["fits"] is False and record["mesh"]["fsdp"] == 8
    fit = record["fit"]
    assert fit is not None and fit["peak_gib"] * 1024 <= 25
    assert "mesh.fsdp=8" in fit["overrides"]  # the config's own mesh had a plan that fits
    tried = [line for line in out if line.startswith("  mesh.")]
    assert len(tried) == fit["tried"] <= 6
    assert any("model.remat=none grpo.micro_batches=1" in line and "does not fit" in line for line in tried)
    assert not any("model.remat=full" in line for line in tried)  # dots fitted at one micro-batch already


def test_tensor_parallel_sampling_layout_halves_the_sampler_weights(v5e):
    # Heads and MLP over `tensor` (SAMPLE_RULES keeps them there; the tiny model's 4 query / 2 KV heads and
    # 128-wide MLP split in two, and so does its vocabulary): every projection of the sampling copy is halved,
    # the decode loop all-reduces activations per layer (Megatron style) and still copies no weight.
    from jgrpo.planning.abstract_run import lower_iteration
    from jgrpo.planning.hlo_cost import HloCost
    from jgrpo.planning.hlo_inspect import big_copies_in_loops, collectives_in_loops

    base = load_config("configs/tiny.yaml", TINY)
    tp = load_config("configs/tiny.yaml", TINY + ["mesh.fsdp=4", "mesh.tensor=2"])
    whole, split = abstract_run(base, v5e), abstract_run(tp, v5e)
    cfg = whole.cfg
    D, L = cfg.hidden_size, cfg.num_layers
    projections = L * (2 * D * cfg.num_heads * cfg.head_dim + 2 * D * cfg.num_kv_heads * cfg.head_dim
                       + 3 * D * cfg.intermediate_size) + cfg.vocab_size * D
    norms = (2 * L + 1) * D
    assert per_chip_bytes(whole.sample_params) == 4 * (projections + norms)
    assert per_chip_bytes(split.sample_params) == 4 * (projections // 2 + norms)
    sample = lower_iteration(tp, v5e, names=("sample",)).programs[0].lowered.compile()
    cost = HloCost(sample.as_text())
    assert big_copies_in_loops(cost, min_bytes=1024) == []
    decode = [c for c in collectives_in_loops(cost)
              if c.opcode.startswith("all-reduce") and c.trips == tp.sampler.max_new_tokens - 1]
    assert len(decode) >= 2 * L  # attention and MLP outputs, per layer, per decoded token


def test_a_shared_compile_cache_never_mixes_two_configs():
    # fit's cache keys programs by the knobs it varies; another config's sampler must not be a cache hit.
    from jgrpo.planning.fit import _program_key

    tiny, quick = load_config("configs/tiny.yaml", TINY), load_config("configs/quickstart.yaml", TINY)
    assert _program_key("sample", tiny) != _program_key("sample", quick)
    fewer = load_config("configs/tiny.yaml", TINY + ["grpo.micro_batches=2", "model.remat=full"])
    assert _program_key("sample", tiny) == _program_key("sample", fewer)  # the sampler ignores those knobs
    assert _program_key("update", tiny) != _program_key("update", fewer)


def test_splash_attention_is_the_tpu_choice_and_compiles_for_v5e(v5e):
    """`model.attention: auto` on a TPU slice is the Pallas kernel, inside the trainer's update as compiled for
    v5e:2x4 (a Mosaic custom call), with less update memory than `xla` once sequences are long enough for the
    [T, S] scores to matter (512 new tokens here; at the tiny config's 24 tokens the 128-token blocks cost more)."""
    from jgrpo.planning.abstract_run import lower_iteration

    def update(attention):
        config = load_config("configs/tiny.yaml", TINY + [f"model.attention={attention}", "sampler.max_new_tokens=512"])
        iteration = lower_iteration(config, v5e, names=("update",))
        assert iteration.run.cfg.attention == ("splash" if attention == "auto" else attention)
        return iteration.programs[0].lowered.compile()

    splash, xla = update("auto"), update("xla")
    assert "tpu_custom_call" in splash.as_text() and "tpu_custom_call" not in xla.as_text()
    assert splash.memory_analysis().temp_size_in_bytes <= xla.memory_analysis().temp_size_in_bytes


def test_a_program_the_tpu_compiler_refuses_for_memory_is_a_verdict_not_a_crash(v5e):
    import jax
    import jax.numpy as jnp

    from jgrpo.planning.fit import compile_program, refused_bytes

    # Sorting a 45000^2 outer product needs ~24 GiB of temporaries: more than a v5e chip's 16 GiB HBM.
    x = jax.ShapeDtypeStruct((45_000,), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(v5e[0]))
    sort_outer = jax.jit(lambda x: jnp.sort(jnp.outer(x, x).reshape(-1))[:8])
    report = compile_program("update", sort_outer.lower(x), runs=2.0)
    assert report.refused.startswith("RESOURCE_EXHAUSTED") and "exceeds available HBM" in report.refused
    assert 20 * 2**30 < report.temp_bytes == report.live_bytes < 30 * 2**30 and report.runs == 2.0
    assert refused_bytes("RESOURCE_EXHAUSTED: ... HLO temporaries (512M) exceeds available HBM (15.75G).") == 2**29
    assert refused_bytes("UNIMPLEMENTED: Stable sorting of more than 2^31-1 elements") is None
    # Any other compile error is still raised.
    too_long = jax.ShapeDtypeStruct((50_000,), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(v5e[0]))
    with pytest.raises(Exception, match="UNIMPLEMENTED"):
        compile_program("update", sort_outer.lower(too_long))


def test_a_packed_run_plans_its_packed_programs_at_a_chosen_count(v5e):
    # model.packing: the planner lowers the packed passes and update (their plans as abstract arrays on the data
    # shards); their loop over the micro-batches used has a traced trip count, which the cost counts at the count
    # asked for (default grpo.micro_batches, as padded) and refuses to guess without one. Memory is the fixed
    # buffer's: one compiled program for every count. Two row buckets (half the rows, or all): a conditional in the
    # loop, costed at its largest branch.
    from jgrpo.planning.abstract_run import lower_iteration
    from jgrpo.planning.hlo_cost import HloCost

    config = load_config("configs/tiny.yaml", [*TINY, "model.packing=true", "grpo.micro_batches=2", "grpo.beta=0.04",
                                               "model.packing_row_buckets=[0.5]"])
    names = ("update",)  # (the passes' loop is the same kind: `PackedLayout.logprobs`)
    assert [p.traced_trips for p in lower_iteration(config, v5e, names=("ref_logprobs", *names)).programs] == [2, 2]
    iteration = lower_iteration(config, v5e, names=names, packed_micro_batches=1)
    for program in iteration.programs:
        assert program.traced_trips == 1
        text = program.lowered.compile().as_text()
        one, two = HloCost(text, 1).flops, HloCost(text, 2).flops
        assert 1.8 < two / one < 2.2, program.name  # the loop body is nearly all of it
        with pytest.raises(ValueError, match="cannot read the trip count"):
            _ = HloCost(text).flops
