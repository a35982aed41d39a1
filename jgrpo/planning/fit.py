"""Plans of one training iteration on a TPU slice: compile, measure, and search for one that fits.

`plan_iteration` compiles the programs `abstract_run.lower_iteration` lowers and returns, per chip and per
program, memory (XLA's memory analysis), executed matmul FLOPs and HBM bytes (`hlo_cost`, loops counted),
collectives and big copies inside loops (`hlo_inspect`), and for the iteration its peak and model FLOPs.
`fit` searches the knobs that trade memory for time (model.remat, grpo.micro_batches, model.logprob_chunk,
the mesh) for the fastest plan (by roofline) that fits; compiled programs are shared between the candidates
that would compile the same program (the sampler depends on the mesh only, the update on all four).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import time

import jax

from jgrpo.config import Config, MeshConfig
from jgrpo.config.loading import load_config
from jgrpo.parallel.mesh import SAMPLE_RULES, TRAIN_RULES, Rules
from jgrpo.planning.abstract_run import Iteration, lower_iteration, parameter_count, program_names
from jgrpo.planning.decode_reads import decode_cache_bytes, decode_weight_bytes
from jgrpo.planning.hlo_cost import HloCost
from jgrpo.planning.hlo_inspect import loops
from jgrpo.planning.hlo_inspect import summary as loop_summary
from jgrpo.planning.paged_rows import KVShape
from jgrpo.planning.roofline import Chip, iteration_model_flops, roofline

GIB = 2**30


@dataclasses.dataclass
class ProgramReport:
    name: str
    compile_s: float
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    resident_argument_bytes: int  # arguments that are the iteration's resident buffers (not extra)
    flops: float = 0.0  # executed matmul FLOPs per chip, loops counted (hlo_cost)
    hbm_bytes: float = 0.0  # HBM traffic per chip, loops counted (hlo_cost)
    runs: float = 1.0  # times per iteration (updates per batch; 1/v for the behaviour copy)
    loops: dict = dataclasses.field(default_factory=dict)  # collectives and big copies inside its loops
    # HBM bytes of the costliest single trip of a top-level loop (the sampler: its last decode step)
    step_bytes: float = 0.0
    # The sampler's decode step: bytes of the weights it reads, by element type (`decode_reads`), e.g. {"bf16": n}
    decode_weight_bytes: dict = dataclasses.field(default_factory=dict)
    # and of the KV cache, by element type (`decode_reads.decode_cache_bytes`): {"bf16": n}, int8 {"f32", "s8"}
    decode_cache_bytes: dict = dataclasses.field(default_factory=dict)
    # XLA's reason when the TPU compiler refused the program for memory (then temp_bytes is what it asked
    # for, and there is no cost: the plan does not fit)
    refused: str = ""

    @property
    def live_bytes(self) -> int:
        """Bytes this program adds on top of the resident buffers while it runs."""
        extra_args = self.argument_bytes - self.resident_argument_bytes
        return extra_args + self.temp_bytes + self.output_bytes - self.alias_bytes


# How XLA's TPU compiler refuses a program bigger than HBM, e.g. "RESOURCE_EXHAUSTED: Ran out of memory on HBM,
# the total memory required for HLO temporaries (23.63G) exceeds available HBM (15.75G)."
_REFUSAL = re.compile(r"RESOURCE_EXHAUSTED:.*?\(([\d.]+)([KMGT]?)\) exceeds available HBM", re.DOTALL)


def refused_bytes(message: str) -> int | None:
    """The bytes a compile error says the program needed beyond HBM, or None when it is not such a refusal."""
    match = _REFUSAL.search(message)
    if match is None:
        return None
    return int(float(match[1]) * 1024 ** " KMGT".index(match[2] or " "))


def compile_program(name: str, lowered, resident_argument_bytes: int = 0, runs: float = 1.0,
                    head_dim: int = 0, traced_trips: int | None = None) -> ProgramReport:
    """Compile `lowered` (one of `lower_iteration`'s programs) and measure it (per chip). A program the TPU
    compiler refuses for memory is reported with the temporaries it asked for (and `refused`), not raised.
    `head_dim`: the model's, to find a sampler's KV cache reads (0: not reported). `traced_trips`: a packed
    program's micro-batches (`abstract_run.Program.traced_trips`)."""
    start = time.perf_counter()
    try:
        compiled = lowered.compile()
    except Exception as e:  # noqa: BLE001 - XLA raises its runtime error type; only a memory refusal is ours
        needed = refused_bytes(str(e))
        if needed is None:
            raise
        return ProgramReport(name, time.perf_counter() - start, 0, 0, needed, 0, 0, runs=runs,
                             refused=str(e).strip().splitlines()[0])
    seconds = time.perf_counter() - start
    memory = compiled.memory_analysis()
    text = compiled.as_text()
    if os.environ.get("JGRPO_PLAN_DUMP"):  # a directory: keep each program's TPU HLO for inspection
        os.makedirs(os.environ["JGRPO_PLAN_DUMP"], exist_ok=True)
        with open(os.path.join(os.environ["JGRPO_PLAN_DUMP"], f"{name}.hlo"), "w") as f:
            f.write(text)
    cost = HloCost(text, traced_trips)
    top_level = {ins.name for ins in cost.computations[cost.entry]}
    step_bytes = max((cost.bytes_of(body) for ins, body, _ in loops(cost) if ins.name in top_level), default=0.0)
    return ProgramReport(name, seconds, int(memory.argument_size_in_bytes), int(memory.output_size_in_bytes),
                         int(memory.temp_size_in_bytes), int(memory.alias_size_in_bytes),
                         resident_argument_bytes, cost.flops, cost.bytes, runs, loop_summary(cost), step_bytes,
                         *_decode_reads(name, lowered, cost, head_dim))


def _decode_reads(name: str, lowered, cost: HloCost, head_dim: int) -> tuple[dict, dict]:
    """A sampler's (`sample`, `eval`: params first among its arguments) decode-step weight and cache reads by
    dtype; {} for other programs, or when jit dropped an unused argument (the parameter numbers would not be the
    leaves')."""
    if name not in ("sample", "eval"):
        return {}, {}
    args, _ = lowered.args_info
    entry = [i for i in cost.computations[cost.entry] if i.opcode == "parameter"]
    if len(entry) != len(jax.tree.leaves(args)):
        return {}, {}
    weights = set(range(len(jax.tree.leaves(args[0]))))
    return decode_weight_bytes(cost, weights), decode_cache_bytes(cost, weights, head_dim) if head_dim else {}


def _program_key(name: str, config: Config) -> tuple:
    """What a program's compiled form depends on, among the knobs `fit` varies (the rest of the config is
    fixed during a search)."""
    m, g = config.model, config.grpo
    # Everything else of the config, so a cache shared across configs never mixes two runs' programs.
    rest = repr(dataclasses.replace(config, mesh=MeshConfig(),
                                    model=dataclasses.replace(m, remat="none", logprob_chunk=1),
                                    grpo=dataclasses.replace(g, micro_batches=1)))
    mesh = (config.mesh.data, config.mesh.fsdp, config.mesh.expert, config.mesh.tensor)
    if name in ("sample", "eval", "behaviour"):
        return rest, name, mesh
    if name in ("assemble", "m2po_mask", "shuffle"):
        return rest, name, mesh, g.micro_batches
    if name in ("ref_logprobs", "lp_k"):
        return rest, name, mesh, g.micro_batches, m.logprob_chunk
    return rest, name, mesh, g.micro_batches, m.logprob_chunk, m.remat


def plan_iteration(config: Config, devices: list, *, train_rules: Rules = TRAIN_RULES,
                   sample_rules: Rules = SAMPLE_RULES, cache: dict | None = None,
                   packed_micro_batches: int | None = None) -> dict:
    """Compile one iteration's programs of `config` for `devices`: per-chip memory and cost of each, and of the
    iteration. With `cache` (a dict kept across calls of one search), programs compiled before are reused.
    `packed_micro_batches`: with `model.packing`, the micro-batches per minibatch its programs are costed at
    (`lower_iteration`)."""
    cache = {} if cache is None else cache
    todo = tuple(n for n in program_names(config) if _program_key(n, config) not in cache)
    iteration = lower_iteration(config, devices, names=todo, train_rules=train_rules, sample_rules=sample_rules,
                                packed_micro_batches=packed_micro_batches)
    for p in iteration.programs:
        # Programs of other configs can be the very same (the sampler of two GRPO variants): reuse by content.
        content = (p.name, hashlib.sha1(p.lowered.as_text().encode()).hexdigest(), p.traced_trips)
        if content in cache:
            report = dataclasses.replace(cache[content], resident_argument_bytes=p.resident_argument_bytes,
                                         runs=p.runs)
        else:
            report = cache[content] = compile_program(p.name, p.lowered, p.resident_argument_bytes, p.runs,
                                                      iteration.run.cfg.head_dim, p.traced_trips)
        cache[_program_key(p.name, config)] = report
    reports = [cache[_program_key(n, config)] for n in program_names(config)]
    return _summarise(config, devices, iteration, reports)


def _summarise(config: Config, devices: list, iteration: Iteration, reports: list[ProgramReport]) -> dict:
    g, run, resident = config.grpo, iteration.run, iteration.resident
    B, G, P, N = (iteration.shape[k] for k in "BGPN")
    worst = max(reports, key=lambda r: r.live_bytes)
    forward_passes = (g.beta > 0) + (run.steps.lp_k_source == "computed")
    return {
        "model": config.model.name,
        "parameters": parameter_count(run.whole()),
        "trainable_parameters": parameter_count(run.params),  # the adapters only with LoRA
        "mesh": dict(run.mesh.shape),
        "chips": len(devices),
        "hosts": len({d.process_index for d in devices}),
        "prompts_per_host": B / len({d.process_index for d in devices}),
        "model_flops": iteration_model_flops(run.cfg, prompts=B, samples=G, prompt_len=P, new_tokens=N,
                                             train_passes=g.inner_steps, forward_passes=forward_passes),
        "tokens": {"sampled": B * G * N, "trained": B * G * (P + N) * g.inner_steps},
        "resident_bytes": resident,
        "programs": [dataclasses.asdict(r) | {"live_bytes": r.live_bytes} for r in reports],
        "peak_bytes": sum(resident.values()) + worst.live_bytes,
        "peak_program": worst.name,
        "compile_s": sum(r.compile_s for r in reports),
        "sampler": sampler_pages(iteration, reports),
    }


def sampler_pages(iteration: Iteration, reports: list[ProgramReport]) -> dict:
    """The sampler's paged cache on one chip: its pool, what a token's keys/values take, and the bytes the chip
    holds while sampling without the pool (what rows in flight have to fit beside: `paged_rows`)."""
    run, (B, G, P, N) = iteration.run, (iteration.shape[k] for k in "BGPN")
    sample = next((r for r in reports if r.name == "sample"), None)
    if sample is None:
        return {}
    plan = run.sampler.spec(B, P, run.cfg).plan
    kv = KVShape(run.cfg.num_layers, run.cfg.num_kv_heads // _tensor_shards(run.mesh, run.cfg.num_kv_heads),
                 run.cfg.head_dim, plan.kv_dtype)
    pool = plan.pages * plan.page_size * kv.token_bytes()
    return {"page_size": plan.page_size, "pages": plan.pages, "pool_bytes": pool, "token_bytes": kv.token_bytes(),
            "group": G, "prompt_width": P, "new_tokens": N, "slots_per_chip": plan.slots_per_queue,
            "without_pool_bytes": sum(iteration.resident.values()) + sample.live_bytes - pool,
            "kv": dataclasses.asdict(kv), "attention": plan.attention}


def _tensor_shards(mesh, kv_heads: int) -> int:
    size = mesh.shape.get("tensor", 1)
    return size if kv_heads % size == 0 else 1




@dataclasses.dataclass
class Candidate:
    overrides: tuple[str, ...]  # what `fit` changed, as section.field=value
    peak_gib: float
    fits: bool
    iteration_s: float  # roofline lower bound
    plan: dict


def _mesh_candidates(config: Config, chips: int) -> list[tuple[int, int, int, int]]:
    """(data, fsdp, expert, tensor): the config's mesh, then all-FSDP, and FSDP x tensor=2 / data=2 splits where
    they divide the chips, each with the config's expert axis."""
    from jgrpo.parallel.mesh import mesh_shape

    expert = config.mesh.expert
    meshes = [mesh_shape(config.mesh, chips)]
    if chips % expert == 0:
        rest = chips // expert
        meshes.append((1, rest, expert, 1))
        if rest % 2 == 0 and rest > 2:
            meshes += [(1, rest // 2, expert, 2), (2, rest // 2, expert, 1)]
    return list(dict.fromkeys(meshes))


def fit(path: str, overrides: list[str], devices: list, chip: Chip, hbm_gib: float, *,
        meshes: list[tuple[int, int, int, int]] | None = None, cache: dict | None = None,
        log=print, packed_micro_batches: int | None = None) -> tuple[Candidate | None, list[Candidate]]:
    """The fastest plan (by roofline iteration time) that fits in `hbm_gib` per chip, over model.remat,
    grpo.micro_batches, model.logprob_chunk and the mesh; and every candidate tried. The config's own mesh
    comes first; other meshes (`meshes`, default `_mesh_candidates`) are searched only when no plan fits on
    it (per chip the roofline barely depends on the mesh; memory does).

    Per mesh, remat policies go from none to full and, for each, micro-batches grow (and then the log-prob
    chunk shrinks) only until the plan fits: more micro-batches read the weights more often and smaller chunks
    loop more, so the first plan that fits is that policy's fastest, and a costlier policy is only worth trying
    with fewer micro-batches than a cheaper one needed. Growing stops when the peak is the sampler's (which
    neither knob changes). Candidates the config rejects (rows that do not split) are skipped."""
    base = load_config(path, overrides)
    rows = base.data.batch_size * base.grpo.num_generations // base.grpo.num_minibatches
    micro_batches = [u for u in (1, 2, 4, 8, 16, 32, 64) if rows % u == 0]
    chunks = sorted({c for c in (base.model.logprob_chunk, 128, 64, 32) if c <= base.model.logprob_chunk},
                    reverse=True)
    cache = {} if cache is None else cache
    tried: list[Candidate] = []
    for data, fsdp, expert, tensor in meshes or _mesh_candidates(base, len(devices)):
        if any(c.fits for c in tried):
            break
        limit = len(micro_batches)
        for remat in ("none", "dots", "full"):
            for index, u in enumerate(micro_batches[:limit]):
                candidate = None
                for chunk in chunks:
                    knobs = (f"mesh.data={data}", f"mesh.fsdp={fsdp}", f"mesh.expert={expert}", f"mesh.tensor={tensor}",
                             f"model.remat={remat}", f"grpo.micro_batches={u}", f"model.logprob_chunk={chunk}")
                    try:
                        config = load_config(path, [*overrides, *knobs])
                        plan = plan_iteration(config, devices, cache=cache, packed_micro_batches=packed_micro_batches)
                    except ValueError as e:  # e.g. rows that do not split, heads the tensor axis cannot divide
                        log(f"  skip {' '.join(knobs)}: {e}")
                        break
                    plan["roofline"] = roofline(plan, chip)
                    peak = plan["peak_bytes"] / GIB
                    candidate = Candidate(knobs, peak, peak <= hbm_gib, plan["roofline"]["iteration_s"], plan)
                    tried.append(candidate)
                    log(f"  {' '.join(knobs)}: peak {peak:.2f} GiB in '{plan['peak_program']}', "
                        f"{'fits' if candidate.fits else 'does not fit'}, >= {candidate.iteration_s:.3f} s/iteration")
                    if candidate.fits or plan["peak_program"] not in ("ref_logprobs", "lp_k", "update"):
                        break  # fits, or the chunk is not what holds the peak
                if candidate is None:
                    continue
                if candidate.fits:
                    limit = index
                    break
                if candidate.plan["peak_program"] in ("sample", "eval", "behaviour"):
                    break  # the sampler holds the peak: training knobs cannot bring it down
    fitting = [c for c in tried if c.fits]
    return (min(fitting, key=lambda c: c.iteration_s) if fitting else None), tried
