"""What `jgrpo.plan` counts a paged decode step to read (jgrpo/planning/paged_rows.py), by hand: the `pallas`
kernel copies a part-full page to its last live token rounded up to a tile's rows, the `xla` blocks whole pages."""

import pytest

from jgrpo.models.paged_attention_tpu import read_granule
from jgrpo.planning.paged_rows import KVShape, step_reads


def test_read_granule_is_a_tiles_rows_where_it_divides_the_page():
    assert [read_granule(d, 64) for d in ("float32", "bfloat16", "int8")] == [8, 16, 32]
    assert read_granule("int8", 16) == 16  # a page smaller than the tile: read whole
    assert read_granule("bfloat16", 24) == 24  # a tile that does not divide the page: whole pages


def test_a_step_reads_the_live_tokens_rounded_to_the_granule_or_to_whole_pages():
    kv = KVShape(layers=2, kv_heads=1, head_dim=8, dtype="bfloat16")
    assert kv.token_bytes() == 2 * 2 * 1 * 8 * 2  # keys and values of 2 layers: 64 bytes a token
    rows = [(139, 60), (139, 0), (5, 64)]  # (prompt tokens, own tokens so far)
    whole = step_reads(1000, kv, rows, page_size=64, prompt_width=144, new_tokens=200)
    tiles = step_reads(1000, kv, rows, page_size=64, prompt_width=144, new_tokens=200, granule=16)
    live = 199 + 139 + 69
    assert whole.live_minimum == tiles.live_minimum == 1000 + live * 64
    # Whole pages: (3 + 1) + (3 + 0) + (1 + 1) pages of 64 tokens. Granules of 16: 144 + 64, 144 + 0, 16 + 64.
    assert whole.paged == 1000 + (4 + 3 + 2) * 64 * 64
    assert tiles.paged == 1000 + (208 + 144 + 80) * 64
    assert tiles.paged_over_live == pytest.approx((1000 + 432 * 64) / (1000 + 407 * 64))
    with pytest.raises(ValueError, match="granule of 24 tokens does not divide pages of 64"):
        step_reads(1000, kv, rows, page_size=64, prompt_width=144, new_tokens=200, granule=24)
