"""Export a checkpoint as a Hugging Face model directory: `python -m jgrpo.export RUN_DIR OUT_DIR [--step N]`.

OUT_DIR gets model.safetensors, config.json and the tokenizer files, loadable with
`transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)` (and by anything else that reads HF checkpoints).
The current params of the latest complete checkpoint (or --step) are exported in float32, or in
model.param_dtype when that is bfloat16. A LoRA run (model.lora.rank > 0) exports its base with the adapters
merged in (W + alpha / r A B), or with `--adapters-only` a PEFT adapter directory (adapter_config.json +
adapter_model.safetensors) for `peft.PeftModel.from_pretrained(base, OUT_DIR)`; either way the checkpoint's
adapters are read only if the base weights are the ones they were trained on.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from etils import epath

from jgrpo.config.errors import ConfigError, PathError, exits_on_user_error
from jgrpo.parallel.startup import setup_logging


def export_run(run_dir: str | Path, out_dir: str | Path, step: int | None = None,
               adapters_only: bool = False) -> tuple[Path, int]:
    """Write the checkpointed params of `run_dir` to `out_dir` as an HF directory (a LoRA run's adapters merged
    into its base), or with `adapters_only` a LoRA run's adapters as a PEFT directory; returns (out_dir, iteration).
    """
    from jgrpo.config.loading import load_config
    from jgrpo.models.builtin import resolve_model_dir
    from jgrpo.models.hf import export_hf, llm_config_from_hf, load_params, load_tokenizer
    from jgrpo.models.llm import ModelOptions, abstract_model
    from jgrpo.models.lora import join_adapters, merge_adapters, split_adapters, with_lora, without_lora
    from jgrpo.models.peft_format import export_peft
    from jgrpo.parallel.fingerprint import fingerprint
    from jgrpo.training.checkpoint import Checkpointer

    run_dir = epath.Path(run_dir)  # a local run directory or a bucket (gs://...), as train writes it
    if not (run_dir / "config.yaml").is_file():
        raise PathError(f"{run_dir} is not a run directory (no config.yaml)")
    config = load_config(run_dir / "config.yaml")
    if not (run_dir / "checkpoints").is_dir():
        raise PathError(f"{run_dir} has no checkpoints to export")
    m = config.model
    hf_config = json.loads((resolve_model_dir(m.name) / "config.json").read_text())
    cfg = llm_config_from_hf(hf_config, ModelOptions(param_dtype=m.param_dtype, compute_dtype=m.compute_dtype))
    if adapters_only and not m.lora.rank:
        raise ConfigError(f"--adapters-only: {run_dir} trained full params (model.lora.rank=0): it has no adapters "
                          "to export")
    base, base_id = None, None
    if m.lora.rank:  # the checkpoint holds adapters: read them for this base only
        base = load_params(resolve_model_dir(m.name), cfg)
        base_id = (m.name, fingerprint(base))
        cfg = with_lora(cfg, m.lora.rank, m.lora.alpha, m.lora.targets)
    _, abstract = abstract_model(cfg)
    if base is not None:
        abstract = split_adapters(abstract)[0]
    import jax

    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])  # export gathers everything on one host anyway
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), abstract)
    checkpointer = Checkpointer(run_dir, config.checkpoint, read_only=True, base=base_id)
    restored = checkpointer.restore_params(abstract, step=step)
    if restored is None:
        raise PathError(f"{run_dir / 'checkpoints'} holds no checkpoint")
    params, iteration = restored
    if adapters_only:
        export_peft(params, cfg, out_dir, base_model=m.name)
        return Path(out_dir), iteration
    if base is not None:
        params = merge_adapters(join_adapters(params, base), cfg.lora_scale)
        cfg = without_lora(cfg)
    export_hf(params, cfg, load_tokenizer(m.name), out_dir)
    return Path(out_dir), iteration


@exits_on_user_error
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jgrpo.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="training run directory")
    parser.add_argument("out_dir", help="where to write the HF model directory")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    parser.add_argument("--adapters-only", action="store_true",
                        help="a LoRA run: write its adapters as a PEFT directory instead of the merged model")
    args = parser.parse_args(argv)
    setup_logging()
    out, iteration = export_run(args.run_dir, args.out_dir, args.step, adapters_only=args.adapters_only)
    print(f"exported iteration {iteration} of {args.run_dir} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
