"""What the trainer's step functions compute, besides the model, its params and the mesh: one record every part of
the step reads (`steps.StepFunctions` builds the parts from it; `programs.step_functions` fills it from a run's
config)."""

from __future__ import annotations

from typing import NamedTuple

from jgrpo.config import GRPOConfig
from jgrpo.sampling.methods import SamplingMethod


class StepOptions(NamedTuple):
    """What the step functions compute, besides the model, its params and the mesh."""

    grpo: GRPOConfig  # the objective and the loop's shape
    method: SamplingMethod  # the sampler's: the log-probs process the logits as it does
    logprob_chunk: int  # positions per log-prob chunk (`rl.logprobs`)
    new_tokens: int  # N, the sampler's max_new_tokens
    share_prompts: bool = True  # compute each prompt once for its group (`models.shared_prompt`)
    skip_empty_steps: bool = True  # a step with nothing in the loss changes nothing
    reward_weights: tuple[float, ...] | None = None  # of the reward table's columns (per-reward advantages)
    on_policy: bool | None = None  # the sampling params are always pi_k (`Config.samples_on_policy`)
    routing_replay: bool = False  # a mixture of experts' forwards use the sampler's experts (`model.routing_replay`)
    router_loss_coefs: tuple[float, float] = (0.0, 0.0)  # load balance, z (`model.router_*_loss_coef`)
    packing: bool = False  # the batch's layout: packed micro-batches (`model.packing`, `packed_layout`), or padded
    packing_width: int = 0  # W of a packed row (`model.packing_width`; 0: max_new_tokens rounded up to 8)
    packing_row_buckets: tuple[float, ...] = ()  # `model.packing_row_buckets`: () = every packed row computed

    @property
    def chunks(self) -> int:
        """C: the batch's rows are cut into grpo.num_minibatches * grpo.micro_batches chunks (`step_batch`)."""
        return self.grpo.num_minibatches * self.grpo.micro_batches
