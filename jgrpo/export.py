"""Export a checkpoint as a Hugging Face model directory: `python -m jgrpo.export RUN_DIR OUT_DIR [--step N]`.

OUT_DIR gets model.safetensors, config.json and the tokenizer files, loadable with
`transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)` (and by anything else that reads HF checkpoints).
The current params of the latest complete checkpoint (or --step) are exported in float32, or in
model.param_dtype when that is bfloat16.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from etils import epath

from jgrpo.process_setup import setup_logging


def export_run(run_dir: str | Path, out_dir: str | Path, step: int | None = None) -> tuple[Path, int]:
    """Write the checkpointed params of `run_dir` to `out_dir` as an HF directory; returns (out_dir, iteration)."""
    from jgrpo.checkpoint import Checkpointer
    from jgrpo.config_loading import load_config
    from jgrpo.models.builtin import resolve_model_dir
    from jgrpo.models.hf import export_hf, llm_config_from_hf, load_tokenizer
    from jgrpo.models.llm import abstract_model

    run_dir = epath.Path(run_dir)  # a local run directory or a bucket (gs://...), as train writes it
    if not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory (no config.yaml)")
    config = load_config(run_dir / "config.yaml")
    if not (run_dir / "checkpoints").is_dir():
        raise FileNotFoundError(f"{run_dir} has no checkpoints to export")
    m = config.model
    hf_config = json.loads((resolve_model_dir(m.name) / "config.json").read_text())
    cfg = llm_config_from_hf(hf_config, param_dtype=m.param_dtype, compute_dtype=m.compute_dtype)
    _, abstract = abstract_model(cfg)
    import jax

    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])  # export gathers everything on one host anyway
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), abstract)
    restored = Checkpointer(run_dir, config.checkpoint, read_only=True).restore_params(abstract, step=step)
    if restored is None:
        raise FileNotFoundError(f"{run_dir / 'checkpoints'} holds no checkpoint")
    params, iteration = restored
    export_hf(params, cfg, load_tokenizer(m.name), out_dir)
    return Path(out_dir), iteration


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jgrpo.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="training run directory")
    parser.add_argument("out_dir", help="where to write the HF model directory")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    args = parser.parse_args(argv)
    setup_logging()
    try:
        out, iteration = export_run(args.run_dir, args.out_dir, args.step)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported iteration {iteration} of {args.run_dir} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
