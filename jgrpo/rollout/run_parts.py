"""What sampling needs, loaded in the order that fails fastest: tokenizer, data, rewards, then the model and its
sampler. The trainer job and the rollout job (`rollout.role`) both start from it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from jgrpo.data import build_prompt_iterator, pad_id_for
from jgrpo.models.frozen_base import FrozenBase
from jgrpo.models.hf import load_model, load_tokenizer, model_options
from jgrpo.parallel.mesh import TRAIN_RULES, mesh_platform
from jgrpo.rewards import RewardScorer
from jgrpo.sampling.sampler import Sampler, stop_ids_for


class RunParts(NamedTuple):
    tokenizer: Any
    data: Any  # the prompt iterator
    scorer: RewardScorer
    graphdef: Any
    params: Any  # the params that train (LoRA: the adapters; the base is in `frozen`)
    model_config: Any
    frozen: FrozenBase
    sampler: Sampler


def load_run_parts(config, mesh, sample_mesh, check_data: Callable[[Any], None] = lambda data: None) -> RunParts:
    """Tokenizer, data and rewards before the weights: a bad data row (or `check_data`'s complaint, e.g. a resume
    onto other data) fails in seconds, not after the model has loaded."""
    c, m = config, config.model
    tokenizer = load_tokenizer(m.name)
    data = build_prompt_iterator(c, tokenizer)
    check_data(data)
    scorer = RewardScorer(c.reward)
    graphdef, params, model_config = load_model(
        m.name, model_options(m, mesh_platform(mesh)), mesh=mesh, rules=TRAIN_RULES,
        lora=(m.lora.rank, m.lora.alpha, m.lora.targets), seed=c.run.seed,
    )
    # With LoRA the params that train (and every policy's own copy) are the adapters; the base is frozen.
    params, frozen = FrozenBase.split(params, m.lora.rank > 0, mesh, c.sampler, m.compute_dtype)
    sampler = Sampler.from_config(c.sampler, graphdef=graphdef, num_samples=c.grpo.num_generations,
                                  stop_ids=stop_ids_for(tokenizer, c.sampler.stop_token_ids),
                                  pad_id=pad_id_for(tokenizer), mesh=sample_mesh, cfg=model_config)
    return RunParts(tokenizer, data, scorer, graphdef, params, model_config, frozen, sampler)
