"""The on-device sampler: the engine that samples G completions per prompt (`sampler`), the slot pool that
decodes them with continuous batching (`slot_pool`), and how one token is drawn from the logits (`methods`).
"""
