"""benchmarks/accelerator.py's CPU smoke run: every part runs end to end and its JSON holds every figure."""

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "accelerator.py"


def test_dry_run_writes_every_figure(tmp_path):
    env = {**os.environ, "XLA_FLAGS": "--xla_backend_optimization_level=0"}  # one CPU device, as on one accelerator
    # (and LLVM's passes off, as for the other tests: tests/conftest.py)
    subprocess.run([sys.executable, str(SCRIPT), "--dry-run"], check=True, env=env, cwd=tmp_path,
                   capture_output=True, text=True, timeout=900)
    results = json.loads((tmp_path / "runs" / "accelerator" / "accelerator.json").read_text())  # the default --out
    assert results["dry_run"] and not results["skipped"]
    assert results["hardware"]["platform"] == "cpu" and results["hardware"]["measured_hbm_bytes_per_s"] > 0
    figures = {**results["train"], **results["sampler"], **results["moe"], **results["iteration"]}
    assert set(figures) == {"qwen2.5-0.5b-shapes", "smollm2", "rows_16", "rows_32", "rows_32_int8",
                            "rows_32_int8_cache", "rows_32_scanned", "rows_32_int8_cache_scanned",
                            "rows_32_command_buffers",
                            "qwen3-30b-a3b-block", "v1", "v4"}
    errors = {name: f["error"] for name, f in figures.items() if "error" in f}
    assert not errors, errors
    for name in ("qwen2.5-0.5b-shapes", "smollm2"):
        assert 0 < results["train"][name]["mfu"] and results["train"][name]["model_flops"] > 0
    for figure in results["sampler"].values():
        assert figure["tokens_per_s"] > 0 and 0 < figure["fraction_of_roofline"]
    assert results["sampler"]["rows_32_int8_cache"]["kv_cache_dtype"] == "int8"
    checked = results["attention"]["padded_rows"]
    assert checked["custom"]["finite"] and checked["xla"]["finite"] and checked["xla"]["max_grad_diff"] < 0.1
    assert set(results["moe"]["qwen3-30b-a3b-block"]["train_s"]) == {"sorted_tiles", "ragged", "dense"}
    assert results["iteration"]["v4"]["v"] == 4 and results["iteration"]["v1"]["phases_s"]["iteration"] > 0
