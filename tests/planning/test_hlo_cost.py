"""Loop-aware FLOPs / HBM bytes from compiled TPU HLO (`hlo_cost`) and the in-loop inspection (`hlo_inspect`).

XLA's own cost analysis counts a loop body once; these counts must multiply it by the trip count and agree
with hand-derived FLOPs of the same program, the trainer's forward pass included.
"""

import re

import numpy as np
import pytest

pytest.importorskip("libtpu", reason="the TPU compiler comes with jax[tpu] (bash .ci/install installs it)")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as S  # noqa: E402

from jgrpo.config.loading import load_config  # noqa: E402
from jgrpo.data import bucketed_length  # noqa: E402
from jgrpo.plan import abstract_run, lower_iteration, topology_devices  # noqa: E402
from jgrpo.planning.decode_reads import decode_cache_bytes, decode_weight_bytes  # noqa: E402
from jgrpo.planning.hlo_cost import HloCost  # noqa: E402
from jgrpo.planning.hlo_inspect import big_copies_in_loops, collectives_in_loops, loops  # noqa: E402
from jgrpo.planning.hlo_text import hbm_bytes, type_bytes  # noqa: E402
from jgrpo.planning.roofline import forward_flops  # noqa: E402

TINY = ["checkpoint.every=0", "logging.tensorboard=false", "model.compute_dtype=bfloat16"]


@pytest.fixture(scope="module")
def mesh():
    devices, _ = topology_devices("v5e:2x4")
    return Mesh(np.array(devices).reshape(8), ("d",))


def _compile(f, *args):
    return jax.jit(f).lower(*args).compile()


def test_types_and_memory_spaces():
    assert type_bytes("(s32[], bf16[2,64]{1,0:T(8,128)(2,1)}, pred[3])") == 4 + 256 + 3
    # S(1) is on-chip memory (VMEM): not HBM traffic.
    assert hbm_bytes("(f32[8,128]{1,0:T(8,128)S(1)}, f32[8,128]{1,0:T(8,128)})") == 4096


def test_a_computation_on_another_execution_thread_ends_where_its_brace_closes():
    # v5p offloads some scatters to its SparseCore: their computations close with `}, execution_thread=...`;
    # read as still open, the computations after it were lost (a KeyError planning a MoE on v5p).
    from jgrpo.planning.hlo_text import parse_hlo

    text = """HloModule m
%offloaded (p: s32[1]) -> s32[1] {
  ROOT %p = s32[1]{0} parameter(0)
}, execution_thread="sparsecore"

%after (q: f32[2]) -> f32[2] {
  ROOT %q = f32[2]{0} parameter(0)
}

ENTRY %main (x: f32[2]) -> f32[2] {
  ROOT %x = f32[2]{0} parameter(0)
}
"""
    computations, entry = parse_hlo(text)
    assert entry == "main" and sorted(computations) == ["after", "main", "offloaded"]
    assert [i.name for i in computations["after"]] == ["q"]


def test_an_instruction_over_several_lines_keeps_the_rest_of_its_computation():
    # Splash attention's backend config holds newlines, and a continuation line can start with "}": read as the
    # computation's end, the rest of a layer loop's body was lost (a 30B-A3B update counted 82 of ~625 TFLOP).
    text = """HloModule m
%body (p: f32[8,16]) -> f32[8,16] {
  %p = f32[8,16]{1,0} parameter(0)
  %k = f32[8,16]{1,0} custom-call(%p), frontend_attributes={kernel_metadata={"cfg":"{\\"block_q\\": 128,
\"xprof\": 1}"
}}, metadata={op_name="splash"}
  %w = f32[16,16]{1,0} constant({...})
  ROOT %d = f32[8,16]{1,0} dot(%k, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (x: f32[8,16]) -> f32[8,16] {
  %x = f32[8,16]{1,0} parameter(0)
  ROOT %c = f32[8,16]{1,0} call(%x), to_apply=%body
}
"""
    cost = HloCost(text)
    assert [i.name for i in cost.computations["body"]] == ["p", "k", "w", "d"]
    assert cost.flops == 2 * 8 * 16 * 16


def test_every_fifth_operand_named_behind_an_index_comment_is_read():
    # XLA prints operands 5, 10, ... of a long list as `/*index=5*/%name`: read as a name, that operand had no
    # type, so a decode step's many-operand fusions lost the bytes of every fifth operand and a loop carrying
    # more than five buffers lost its counter's step and start.
    text = """HloModule m
%fused (a: f32[4], b: f32[4], c: f32[4], d: f32[4], e: f32[4], f: f32[1024]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  %b = f32[4]{0} parameter(1)
  %c = f32[4]{0} parameter(2)
  %d = f32[4]{0} parameter(3)
  %e = f32[4]{0} parameter(4)
  %f = f32[1024]{0} parameter(5)
  %s = f32[4]{0} slice(%f), slice={[0:4]}
  %x = f32[4]{0} add(%a, %b)
  %y = f32[4]{0} add(%c, %d)
  %z = f32[4]{0} add(%e, %s)
  %xy = f32[4]{0} add(%x, %y)
  ROOT %r = f32[4]{0} add(%xy, %z)
}

%body (t: (s32[], f32[4], f32[4], f32[4], f32[4], s32[])) -> (s32[], f32[4], f32[4], f32[4], f32[4], s32[]) {
  %t = (s32[], f32[4], f32[4], f32[4], f32[4], s32[]) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %v = f32[4]{0} get-tuple-element(%t), index=1
  %j = s32[] get-tuple-element(%t), index=5
  %two = s32[] constant(2)
  %next = s32[] add(%j, %two)
  ROOT %out = (s32[], f32[4], f32[4], f32[4], f32[4], s32[]) tuple(%i, %v, %v, %v, %v, /*index=5*/%next)
}

%cond (t: (s32[], f32[4], f32[4], f32[4], f32[4], s32[])) -> pred[] {
  %t = (s32[], f32[4], f32[4], f32[4], f32[4], s32[]) parameter(0)
  %j = s32[] get-tuple-element(%t), index=5
  %n = s32[] constant(10)
  ROOT %lt = pred[] compare(%j, %n), direction=LT
}

ENTRY %main (a: f32[4], big: f32[1024]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  %big = f32[1024]{0} parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], f32[4], f32[4], f32[4], f32[4], s32[]) tuple(%zero, %a, %a, %a, %a, /*index=5*/%zero)
  %w = (s32[], f32[4], f32[4], f32[4], f32[4], s32[]) while(%init), condition=%cond, body=%body
  ROOT %r = f32[4]{0} fusion(%a, %a, %a, %a, %a, /*index=5*/%big), kind=kLoop, calls=%fused
}
"""
    cost = HloCost(text)
    assert cost.computations["main"][-1].operands[5] == "big"
    # The fusion: five operands, the slice of the sixth, its output; the loop: 5 trips of one scalar add (2 reads,
    # 1 write).
    assert cost.bytes == 5 * 16 + 16 + 16 + 5 * 3 * 4
    (loop, _, trips), = loops(cost)
    assert trips == 5  # 0, 2, ..., 8: the counter is operand 5 and steps by 2
    # XLA's windowed einsum loops copy the counter before the add (`add(copy(gte), 2)`): still a step of 2 (read as
    # 1, a packed update's LM-head loops counted twice their trips).
    copied = text.replace("%next = s32[] add(%j, %two)", "%jc = s32[] copy(%j)\n  %next = s32[] add(%jc, %two)")
    assert "copy(%j)" in copied and loops(HloCost(copied))[0][2] == 5


def test_a_ragged_all_to_all_counts_as_a_collective_at_its_buffer_size():
    from jgrpo.planning.hlo_inspect import collective_bytes

    text = """HloModule m
ENTRY %main (x: f32[4,2]) -> f32[8,2] {
  %x = f32[4,2]{1,0} parameter(0)
  ROOT %r = f32[8,2]{1,0} ragged-all-to-all(%x, %x, %x, %x, %x, %x), channel_id=1
}
"""
    assert collective_bytes(text) == 8 * 2 * 4


def test_a_conditional_sends_its_largest_branchs_collectives_not_their_sum():
    # A conditional runs one branch (the packed passes' row buckets are one): its bytes are the largest branch's,
    # as its FLOPs and HBM bytes are.
    from jgrpo.planning.hlo_inspect import collective_bytes

    text = """HloModule m
%small (a: f32[4]) -> f32[8] {
  %a = f32[4]{0} parameter(0)
  ROOT %g = f32[8]{0} all-gather(%a), dimensions={0}, channel_id=1
}

%large (b: f32[4]) -> f32[16] {
  %b = f32[4]{0} parameter(0)
  ROOT %h = f32[16]{0} all-gather(%b), dimensions={0}, channel_id=2
}

ENTRY %main (i: s32[], x: f32[4]) -> f32[8] {
  %i = s32[] parameter(0)
  %x = f32[4]{0} parameter(1)
  %c = f32[16]{0} conditional(%i, %x, %x), branch_computations={%small, %large}
  ROOT %r = f32[8]{0} all-gather(%x), dimensions={0}, channel_id=3
}
"""
    assert collective_bytes(text) == 16 * 4 + 8 * 4


def test_a_scanned_matmul_counts_every_iteration(mesh):
    def layers(x, ws):
        return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0]

    x = jax.ShapeDtypeStruct((8 * 64, 512), jnp.bfloat16, sharding=NamedSharding(mesh, S("d")))
    counts = {}
    for n in (2, 12):
        ws = jax.ShapeDtypeStruct((n, 512, 512), jnp.bfloat16, sharding=NamedSharding(mesh, S()))
        compiled = _compile(layers, x, ws)
        cost = HloCost(compiled.as_text())
        assert cost.flops == 2 * 64 * 512 * 512 * n  # per chip: 64 rows each
        assert [trips for _, _, trips in loops(cost)] == [n]
        counts[n] = (cost.bytes, compiled.cost_analysis()["flops"])
        # Each iteration reads its (512 x 512) bf16 weight, not the whole stack.
        assert n * 512 * 512 * 2 <= cost.bytes <= n * 4 * 512 * 512 * 2
    assert counts[2][1] == counts[12][1]  # what XLA's cost analysis says: the loop body once


def test_a_batched_matmul_expressed_as_a_convolution(mesh):
    a = jax.ShapeDtypeStruct((16, 128, 256), jnp.bfloat16, sharding=NamedSharding(mesh, S("d")))
    b = jax.ShapeDtypeStruct((16, 256, 64), jnp.bfloat16, sharding=NamedSharding(mesh, S("d")))
    compiled = _compile(lambda a, b: jnp.einsum("bts,bsd->btd", a, b), a, b)
    assert HloCost(compiled.as_text()).flops == 2 * 2 * 128 * 256 * 64


def test_trainer_forward_and_update_flops_match_the_analytic_count():
    # The trainer's own programs for a 2-layer model on a v5e-8 (2 rows per chip, no prompt sharing so every
    # row is a plain sequence of T tokens). Forward, by hand: per row 2 x T x (layer matmul params) per layer,
    # q.k and p.v over T positions (4 T^2 H hd per layer), and the unembedding on the N completion tokens.
    devices, _ = topology_devices("v5e:2x4")
    counts = {}
    for remat in ("none", "full"):
        # XLA's attention: a Pallas kernel (splash, the TPU default) is a custom call whose FLOPs no HLO shows.
        config = load_config("configs/tiny.yaml", TINY + ["model.share_prompts=false", f"model.remat={remat}",
                                                          "model.attention=xla"])
        programs = lower_iteration(config, devices, names=("ref_logprobs", "update")).programs
        counts[remat] = {p.name: HloCost(p.lowered.compile().as_text()).flops for p in programs}
    run = abstract_run(config, devices)
    cfg = run.cfg
    N = config.sampler.max_new_tokens
    T = bucketed_length(config.data.max_prompt_length, config.sampler.prompt_bucket) + N - 1
    rows = config.data.batch_size * config.grpo.num_generations // 8
    D, H, K, hd, F, V, L = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                            cfg.vocab_size, cfg.num_layers)
    layer_params = D * H * hd + 2 * D * K * hd + H * hd * D + 3 * D * F
    layers = rows * L * (2 * T * layer_params + 4 * T * T * H * hd)
    unembed = rows * 2 * N * V * D
    assert counts["none"]["ref_logprobs"] == pytest.approx(layers + unembed, rel=0.01)
    # Training: forward + backward (3 forwards), and the log-prob chunks recompute their logits in the backward.
    assert counts["none"]["update"] == pytest.approx(3 * (layers + unembed) + unembed, rel=0.02)
    # remat="full" recomputes the layers' forward in the backward pass: one more forward of the layers.
    assert counts["full"]["update"] - counts["none"]["update"] == pytest.approx(layers, rel=0.3)
    assert forward_flops(cfg, rows * T, T) > layers  # the model-FLOPs helper counts the unembedding everywhere


def test_decode_loop_copies_no_weight_or_cache_and_the_check_can_fail(mesh):
    # Positive control: a loop that transposes a carried weight every step copies it in HBM at every step (a
    # 128 MiB weight: too big for the compiler to keep on chip, where moving data is how a TPU computes).
    def transposes(w, x):
        return jax.lax.fori_loop(0, 16, lambda i, c: (c[0].T, c[1] + x @ c[0]), (w, jnp.zeros((64, 8192), w.dtype)))

    w = jax.ShapeDtypeStruct((8192, 8192), jnp.bfloat16, sharding=NamedSharding(mesh, S()))
    x = jax.ShapeDtypeStruct((64, 8192), jnp.bfloat16, sharding=NamedSharding(mesh, S()))
    found = big_copies_in_loops(_compile(transposes, w, x).as_text())
    assert found and all(c.type.startswith("bf16[8192,8192]") and c.trips == 16 for c in found)

    # The sampler's generate for a v5e-8: prefill scan and decode loop, no weight- or cache-sized copy inside,
    # with the layers unrolled in the decode step, or scanned (the TPU default: one more loop, L trips per step);
    # the attention over pages is the Pallas kernel, one custom call per layer and step.
    devices, _ = topology_devices("v5e:2x4")
    N, L = 8, 2
    for layers, trips, calls in (("unrolled", [L, N - 1], L), ("auto", [L, L, N - 1], 1)):  # the first token: prefill
        config = load_config("configs/tiny.yaml", TINY + [f"sampler.decode_layers={layers}"])
        assert config.sampler.max_new_tokens == N
        sample = lower_iteration(config, devices, names=("sample",)).programs[0].lowered.compile().as_text()
        assert sorted(t for _, _, t in loops(HloCost(sample))) == trips
        assert sample.count('custom_call_target="tpu_custom_call"') == calls
        assert big_copies_in_loops(sample, min_bytes=1024) == []
        # Sampling layout: weights whole, rows and their page pools per device. What crosses devices in the loop
        # is two predicates per step (any row waiting to be admitted, any row short of a page), 4 bytes each: the
        # branches that admit and preempt are taken by all devices together.
        assert [c.bytes for c in collectives_in_loops(sample)] == [4, 4]
        # The weights are float32 arguments; XLA casts them to the bfloat16 compute dtype once, outside the
        # loop, and each step reads that copy: every projection, the norms and the tied unembedding once (and
        # the embedding rows of the fed tokens).
        assert decode_weight_bytes(sample, set(range(11))).keys() == {"bf16"}
        assert _TINY_WEIGHTS * 2 <= decode_weight_bytes(sample, set(range(11)))["bf16"] <= _TINY_WEIGHTS * 2 * 1.01
    # sampler.paged_attention=xla reaches the compiled sampler: in each step, each layer reads its rows' pages in a
    # loop of blocks (2 table entries: the prompt's page and one own page of 64 tokens, one block of 4 entries).
    # Computed in float32, the same step reads the float32 arguments themselves: twice the bytes.
    blocks = load_config("configs/tiny.yaml", TINY + ["sampler.paged_attention=xla", "sampler.decode_layers=unrolled",
                                                      "model.compute_dtype=float32"])
    lowered = lower_iteration(blocks, devices, names=("sample",)).programs[0].lowered
    cost = HloCost(lowered.compile().as_text())
    assert sorted(trips for _, _, trips in loops(cost)) == [1, 1, L, N - 1]
    assert decode_weight_bytes(cost, set(range(11))).keys() == {"f32"}
    assert _TINY_WEIGHTS * 4 <= decode_weight_bytes(cost, set(range(11)))["f32"] <= _TINY_WEIGHTS * 4 * 1.01


# configs/tiny.yaml's model: 2 layers of q, k, v, o (64 x 64, 64 x 32 twice, 64 x 64), gate, up, down (64 x 128
# each), 5 norms of 64, and the tied 49,152 x 64 embedding the unembedding reads whole: elements.
_TINY_PROJECTIONS = 2 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128)
_TINY_WEIGHTS = _TINY_PROJECTIONS + 5 * 64 + 49152 * 64


def test_weights_prefetched_in_async_slices_count_once_at_their_reader():
    # A TPU decode step (Qwen2.5-0.5B, unrolled, int8) prefetches each weight into on-chip memory as async slices
    # (slice-start / slice-done), joins them with a "ConcatBitcast" custom call, and the matmul reads that: the
    # weight is read once. Counting the "-done" ops by their operand (the start's tuple holds the whole source) and
    # the join as a read gave 6x the weights (2.1 GB of s8 for a 0.36 GB model).
    text = """HloModule m
%dot (x: bf16[2,8], w: s8[8,16]) -> f32[2,16] {
  %x = bf16[2,8]{1,0} parameter(0)
  %w = s8[8,16]{1,0} parameter(1)
  ROOT %d = f32[2,16]{1,0} convolution(%x, %w), dim_labels=bf_io->bf
}

%body (t: (s32[], bf16[2,8], s8[8,16])) -> (s32[], bf16[2,8], s8[8,16]) {
  %t = (s32[], bf16[2,8], s8[8,16]) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = bf16[2,8]{1,0} get-tuple-element(%t), index=1
  %w = s8[8,16]{1,0} get-tuple-element(%t), index=2
  %s0 = ((s8[8,16]{1,0}), s8[4,16]{1,0:S(1)}, s32[]) slice-start(%w), slice={[0:4], [0:16]}
  %s1 = ((s8[8,16]{1,0}), s8[4,16]{1,0:S(1)}, s32[]) slice-start(%w), slice={[4:8], [0:16]}
  %d0 = s8[4,16]{1,0:S(1)} slice-done(%s0)
  %d1 = s8[4,16]{1,0:S(1)} slice-done(%s1)
  %joined = s8[8,16]{1,0:S(1)} custom-call(%d0, %d1), custom_call_target="ConcatBitcast"
  %y = f32[2,16]{1,0} fusion(%x, %joined), kind=kOutput, calls=%dot
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %out = (s32[], bf16[2,8], s8[8,16]) tuple(%next, %x, %w)
}

%cond (t: (s32[], bf16[2,8], s8[8,16])) -> pred[] {
  %t = (s32[], bf16[2,8], s8[8,16]) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (w: s8[8,16], x: bf16[2,8]) -> (s32[], bf16[2,8], s8[8,16]) {
  %w = s8[8,16]{1,0} parameter(0)
  %x = bf16[2,8]{1,0} parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[2,8], s8[8,16]) tuple(%zero, %x, %w)
  ROOT %loop = (s32[], bf16[2,8], s8[8,16]) while(%init), condition=%cond, body=%body
}
"""
    assert decode_weight_bytes(text, {0}) == {"s8": 8 * 16}


def test_a_layer_sliced_from_a_relaid_stack_inside_a_fusion_counts_the_slice_only():
    # A TPU scanned decode with int8 weights (Qwen2.5-0.5B, v5e): the matmul's fusion takes the whole s8 stack
    # [L, in, out], stored in (32, 128) tiles, and slices the layer inside a nested fusion that first re-tiles the
    # stack to the matmul's (8, 128): `copy` then `dynamic-slice`, fused, so only the slice is read (the chip's own
    # estimate agreed: that fusion's estimated cycles were 0.67x bf16's, not 24x). Counting the nested copy as a
    # read of the whole stack reported 8.9 GB a step for a 0.73 GB model.
    text = """HloModule m
%relayout (a: s8[4,8,16]) -> s8[4,8,16] {
  %a = s8[4,8,16]{2,1,0:T(32,128)(4,1)} parameter(0)
  ROOT %c = s8[4,8,16]{2,1,0:T(8,128)(4,1)} copy(%a)
}

%layer (stack: s8[4,8,16], i: s32[]) -> s8[8,16] {
  %stack = s8[4,8,16]{2,1,0:T(32,128)(4,1)} parameter(0)
  %i = s32[] parameter(1)
  %tiled = s8[4,8,16]{2,1,0:T(8,128)(4,1)} fusion(%stack), kind=kLoop, calls=%relayout
  %zero = s32[] constant(0)
  %one = s8[1,8,16]{2,1,0:T(8,128)(4,1)} dynamic-slice(%tiled, %i, %zero, %zero), dynamic_slice_sizes={1,8,16}
  ROOT %w = s8[8,16]{1,0:T(8,128)(4,1)} bitcast(%one)
}

%dot (x: bf16[2,8], stack: s8[4,8,16], i: s32[]) -> f32[2,16] {
  %x = bf16[2,8]{1,0} parameter(0)
  %stack = s8[4,8,16]{2,1,0:T(32,128)(4,1)} parameter(1)
  %i = s32[] parameter(2)
  %w = s8[8,16]{1,0:T(8,128)(4,1)} fusion(%stack, %i), kind=kLoop, calls=%layer
  ROOT %d = f32[2,16]{1,0} convolution(%x, %w), dim_labels=bf_io->bf
}

%body (t: (s32[], bf16[2,8], s8[4,8,16])) -> (s32[], bf16[2,8], s8[4,8,16]) {
  %t = (s32[], bf16[2,8], s8[4,8,16]) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = bf16[2,8]{1,0} get-tuple-element(%t), index=1
  %stack = s8[4,8,16]{2,1,0:T(32,128)(4,1)} get-tuple-element(%t), index=2
  %y = f32[2,16]{1,0} fusion(%x, %stack, %i), kind=kOutput, calls=%dot
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %out = (s32[], bf16[2,8], s8[4,8,16]) tuple(%next, %x, %stack)
}

%cond (t: (s32[], bf16[2,8], s8[4,8,16])) -> pred[] {
  %t = (s32[], bf16[2,8], s8[4,8,16]) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (w: s8[4,8,16], x: bf16[2,8]) -> (s32[], bf16[2,8], s8[4,8,16]) {
  %w = s8[4,8,16]{2,1,0:T(32,128)(4,1)} parameter(0)
  %x = bf16[2,8]{1,0} parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[2,8], s8[4,8,16]) tuple(%zero, %x, %w)
  ROOT %loop = (s32[], bf16[2,8], s8[4,8,16]) while(%init), condition=%cond, body=%body
}
"""
    assert decode_weight_bytes(text, {0}) == {"s8": 8 * 16}  # one layer a trip, not the stack
    # Control: the same relayout as the fusion's output (nothing sliced after it) reads the whole stack.
    whole = text.replace("%one = s8[1,8,16]{2,1,0:T(8,128)(4,1)} dynamic-slice(%tiled, %i, %zero, %zero), "
                         "dynamic_slice_sizes={1,8,16}", "%one = s8[1,8,16]{2,1,0:T(8,128)(4,1)} add(%tiled, %tiled)")
    assert whole != text and decode_weight_bytes(whole, {0}) == {"s8": 4 * 8 * 16}


def test_an_int8_sampler_reads_every_projection_as_int8_once_per_decode_step():
    # sampler.weights_dtype=int8 (models/quantize.py): the decode step must read the projections' int8 bytes, not
    # a bfloat16 copy XLA could hoist out of the loop (the f32 -> bf16 cast of float weights is hoisted: the test
    # above), nor the whole int8 stack per layer. Positive control: the bfloat16 program fails the same check.
    # The TPU default decode is scanned; the unrolled one must read the same.
    from jgrpo.models.quantize import PROJECTIONS

    devices, _ = topology_devices("v5e:2x4")
    reads, embedding = {}, {}
    for variant in ("int8", "bfloat16", "int8+embeddings", "int8@unrolled"):
        variant, _, layers = variant.partition("@")
        dtype, *embeddings = variant.split("+")
        config = load_config("configs/tiny.yaml", TINY + [f"sampler.weights_dtype={dtype}",
                                                          f"sampler.quantize_embeddings={bool(embeddings)}",
                                                          f"sampler.decode_layers={layers or 'auto'}"])
        variant += f"@{layers}" if layers else ""
        program = lower_iteration(config, devices, names=("sample",)).programs[0]
        leaves = jax.tree_util.tree_flatten_with_path(program.lowered.args_info[0][0])[0]
        projections = {i for i, (path, _) in enumerate(leaves) if path[-1].key in PROJECTIONS}
        assert len(projections) == len(PROJECTIONS)
        cost = HloCost(program.lowered.compile().as_text())
        reads[variant] = decode_weight_bytes(cost, projections)
        embed = next(i for i, (path, _) in enumerate(leaves) if path[0].key == "embed")
        embedding[variant] = decode_weight_bytes(cost, {embed})

    def int8_only(read):
        return read.keys() == {"s8"}

    assert int8_only(reads["int8"]) and reads["int8"]["s8"] == _TINY_PROJECTIONS  # each int8 byte once a step
    assert reads["int8@unrolled"] == reads["int8"]
    assert not int8_only(reads["bfloat16"]) and reads["bfloat16"].keys() == {"bf16"}
    # sampler.quantize_embeddings: the tied embedding, which the lm_head reads whole every step, is read as int8;
    # without it, in the compute dtype.
    assert int8_only(embedding["int8+embeddings"]) and embedding["int8+embeddings"]["s8"] >= 49152 * 64
    assert not int8_only(embedding["int8"]) and embedding["int8"]["bf16"] >= 49152 * 64 * 2


def test_an_int8_kv_cache_is_read_as_int8_in_the_decode_step():
    # sampler.kv_cache_dtype=int8 (models/kv_quant.py): the decode step reads the pages' int8 values and their
    # float32 per-token scales (4 bytes per 16 int8 values, head_dim), fewer bytes than the bfloat16 cache, nothing
    # dequantized in bfloat16. Positive control: the bfloat16 cache's program fails the same check. Both decode
    # forms (the TPU default is scanned), with the xla attention (the Pallas kernel's reads are counted from the
    # page tables: jgrpo.planning.paged_rows).
    devices, _ = topology_devices("v5e:2x4")
    scales, values = {}, {}
    for layers in ("scanned", "unrolled"):
        reads = {}
        for dtype in ("int8", "bfloat16"):
            config = load_config("configs/tiny.yaml", TINY + [f"sampler.kv_cache_dtype={dtype}",
                                                              f"sampler.decode_layers={layers}",
                                                              "sampler.paged_attention=xla"])
            program = lower_iteration(config, devices, names=("sample",)).programs[0]
            weights = set(range(len(jax.tree.leaves(program.lowered.args_info[0][0]))))
            reads[dtype] = decode_cache_bytes(HloCost(program.lowered.compile().as_text()), weights, head_dim=16)

        def int8_only(read):
            return read.keys() == {"s8", "f32"}

        assert int8_only(reads["int8"]) and not int8_only(reads["bfloat16"]), layers
        assert reads["bfloat16"].keys() == {"bf16"}, layers
        # Each int8 byte where the bfloat16 cache reads two, in both forms (unrolled, XLA computes some of the
        # keys' scores ahead of the block loop for either dtype alike: 36864 int8 bytes against 73728; scanned,
        # 49152 against 98304). Blocks of table entries longer than the tiny model's tables scheduled the two
        # dtypes differently (unrolled, 49152 int8 bytes against 73728 bfloat16).
        assert reads["int8"]["s8"] * 2 == reads["bfloat16"]["bf16"], layers
        scales[layers] = reads["int8"]["f32"]
        values[layers] = reads["int8"]["s8"]
    # The scales: one float32 per head_dim int8 values of the whole step, 12288 bytes in both forms. (In blocks
    # longer than the table, XLA followed the scanned step's scatter of the new scales with a relayout copy of the
    # layer's scales: a third more.)
    assert scales["scanned"] == scales["unrolled"] == values["scanned"] // 16 * 4


def test_continuous_decode_loops_are_bounded_by_the_worst_case_and_copy_free():
    # Fewer slots than rows: a slot whose row stops takes the next. The decode loop is bounded by a counter at the
    # worst case (every row feeds N - 1 tokens, in as many rounds as a queue's slots take its rows), so the planner
    # reads its trip count where a data-dependent bound would be unreadable: 16 rows in 8 slots (one per chip) are
    # 2 rounds of 7 steps. No copy of the cache per step, and each chip admits its own rows into its own slots
    # with pages of its own pool: what crosses chips per step are scalar all-reduces (whether anything waits or
    # runs, which admission branch every chip takes: the branch and the loop's exit must be the same on all).
    devices, _ = topology_devices("v5e:2x4")
    L = 2
    for layers, per_step in (("unrolled", []), ("auto", [L])):  # scanned: one layer scan in the decode loop
        config = load_config("configs/tiny.yaml", TINY + ["sampler.slots=8", f"sampler.decode_layers={layers}"])
        cost = HloCost(lower_iteration(config, devices, names=("sample",)).programs[0].lowered.compile().as_text())
        assert sorted(t for _, _, t in loops(cost)) == sorted([L, 2 * 7, *per_step])
        assert big_copies_in_loops(cost, min_bytes=1024) == []
        collectives = collectives_in_loops(cost)
        assert collectives and all(c.opcode == "all-reduce" and c.bytes <= 4 for c in collectives), collectives
    # The behaviour window (v = 2): both iterations' 32 rows through one iteration's 16 slots: 2 rounds.
    window = load_config("configs/tiny.yaml", TINY + ["rollout.mode=window", "grpo.behaviour_refresh=2",
                                                      "sampler.decode_layers=unrolled"])
    program = lower_iteration(window, devices, names=("sample",)).programs[0]
    assert program.runs == 1 / 2
    assert sorted(t for _, _, t in loops(HloCost(program.lowered.compile().as_text()))) == [L, 2 * 7]


def test_a_tiny_moe_with_its_experts_split_compiles_for_tpu_with_ragged_all_to_alls():
    # mesh.expert=2 on a v5e-8: model.moe_dispatch auto is ragged_all_to_all on TPU (XLA:CPU lacks the op, so the
    # CPU tests run its emulation); the update exchanges assignments with it, forward and backward.
    devices, _ = topology_devices("v5e:2x4")
    config = load_config("configs/tiny_moe.yaml", TINY + ["mesh.expert=2", "model.attention=xla"])
    (update,) = lower_iteration(config, devices, names=("update",)).programs
    assert update.lowered.compile().as_text().count("ragged-all-to-all(") >= 4  # 2 layers, there and back


def test_the_megablox_moe_layer_compiles_for_tpu_forward_and_backward():
    # The TPU default (model.moe_impl auto): the Pallas grouped matmul, per device over an 8-chip mesh. At the
    # default matmul precision: under the tests' global "highest" Mosaic refuses the backward's bf16 matmuls (the
    # layer resets the precision around its forward calls only; the custom VJP's backward is traced outside).
    from jgrpo.models.moe import moe_mlp

    devices, _ = topology_devices("v5e:2x4")
    mesh = Mesh(np.array(devices).reshape(1, 8, 1, 1), ("data", "fsdp", "expert", "tensor"))
    E, D, F = 8, 256, 128

    def shaped(shape, spec):
        return jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, spec))

    p = {"router": shaped((D, E), S()), "experts_gate": shaped((E, D, F), S()), "experts_up": shaped((E, D, F), S()),
         "experts_down": shaped((E, F, D), S())}

    def loss(h, p):
        y, _, _ = moe_mlp(h, p, k=2, norm_topk_prob=True, impl="megablox")
        return jnp.sum(y.astype(jnp.float32) ** 2)

    with jax.set_mesh(mesh), jax.default_matmul_precision("default"):
        hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(shaped((8, 32, D), S("fsdp")), p).compile().as_text()
    assert hlo.count("tpu_custom_call") >= 3  # the forward's three grouped matmuls, and their backward's
    # Their FLOPs are the kernels' own estimates (a custom call shows none in the HLO): per chip 32 tokens x k = 2
    # rows through 3 matmuls of D x F, once forward and twice backward (the rows' and the weights' gradients).
    assert HloCost(hlo).flops == pytest.approx(3 * 3 * 2 * (32 * 2) * D * F, rel=0.02)


def _splash_kernel_flops(monkeypatch, attend, last):
    """attend(q, k, v, last)'s gradient compiled for a v5e chip with bf16 q [2, 256, 4, 64] and k, v [2, 384, 2, 64],
    `last` [2, ...] bool: the HLO text and the FLOPs `splash_flops` gives each of its kernels (forward, dq, dkv)."""
    from jgrpo.models import attention_backends
    from jgrpo.planning.hlo_text import parse_hlo
    from jgrpo.planning.op_flops import splash_flops

    monkeypatch.setattr(attention_backends, "context_platform", lambda: "tpu")
    devices, _ = topology_devices("v5e:2x4")
    one = jax.sharding.SingleDeviceSharding(devices[0])
    q = jax.ShapeDtypeStruct((2, 256, 4, 64), jnp.bfloat16, sharding=one)
    kv = jax.ShapeDtypeStruct((2, 384, 2, 64), jnp.bfloat16, sharding=one)

    def loss(q, k, v, last):
        return attend(q, k, v, last).astype(jnp.float32).sum()

    with jax.default_matmul_precision("default"):
        hlo = _compile(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv,
                       jax.ShapeDtypeStruct(last, jnp.bool_, sharding=one)).as_text()
    computations, _ = parse_hlo(hlo)
    kernels = {}
    for body in computations.values():
        types = {i.name: i.type for i in body}
        for ins in body:
            flops = splash_flops(ins, types)
            if flops is not None:
                kernels[re.search(r"splash_mqa_(fwd|dq|dkv)", ins.attributes).group(1)] = flops
    return hlo, kernels


def test_splash_attention_counts_the_blocks_its_causal_mask_computes(monkeypatch):
    # Splash's kernels carry no cost estimate (jax 0.10.2), so their FLOPs are counted from the blocks the mask
    # leaves: 256 queries as the last of 384 keys, 128-blocks. Query block 0 (key slots 128..255) needs key
    # blocks 0-1, query block 1 (256..383) blocks 0-2: 5 of 6 blocks, 5 x 128 x 128 pairs per head.
    from jgrpo.models import attention_backends
    from jgrpo.planning.op_flops import causal_block_pairs

    hlo, kernels = _splash_kernel_flops(monkeypatch, attention_backends._splash, (2, 384))
    assert causal_block_pairs(256, 384, 128, 128) == 5 * 128 * 128
    # The kernel's own block mask (printed while small: 2 = whole block, 1 = partial, 0 = skipped) agrees.
    block_mask = re.search(r"s8\[1,2,3\]\S* constant\(\{ \{ \{ 2, 1, 0 \}, \{ 2, 2, 1 \} \} \}\)", hlo)
    assert block_mask is not None
    per_pair_dim = 2 * 4 * 5 * 128 * 128 * 64  # rows x heads x pairs x Dh
    assert kernels == {"fwd": 4 * per_pair_dim, "dq": 6 * per_pair_dim, "dkv": 8 * per_pair_dim}
    assert HloCost(hlo).flops >= sum(kernels.values())


def test_splash_with_a_mask_per_row_counts_every_block(monkeypatch):
    # The packed forward's mask is data (a "dynamic" mask): which blocks a batch skips is not known when compiling,
    # so its kernels count every block, here 2 query x 3 key blocks of 128 per head and row (the worst case).
    from jgrpo.models import attention_backends

    hlo, kernels = _splash_kernel_flops(monkeypatch, lambda q, k, v, m: attention_backends.masked_attention(
        "splash", q, k, v, m), (2, 256, 384))
    # One call per row (each row's mask is its own kernel's: a loop over the rows), each over the 4 heads.
    per_pair_dim = 4 * 6 * 128 * 128 * 64
    assert kernels == {"fwd": 4 * per_pair_dim, "dq": 6 * per_pair_dim, "dkv": 8 * per_pair_dim}
    assert HloCost(hlo).flops >= 2 * sum(kernels.values())
