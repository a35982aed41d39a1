"""Where an iteration's samples come from: prompts -> sampled, decoded, scored completions (`scoring`); the
sync / window sources (`sources`), dynamic sampling (`dynamic_sampling`), the async producer threads
(`async_producer` between batches, `in_flight` weights updated in flight) and the trainer's side of them
(`intake`), which weights sample and how they reach the sampler (`sampling_weights`), and the held-out evaluator
(`evaluator`).
"""

from jgrpo._moved import moved_attribute

_OLD_NAMES = {name: "jgrpo.rollout.scoring" for name in ("Rollout", "prompt_arrays", "reward_table", "sample_and_score",
                                                          "score_rows")}


def __getattr__(name: str):  # `from jgrpo.rollout import sample_and_score`: the module before the rooms, one release
    return moved_attribute(__name__, name, _OLD_NAMES)
