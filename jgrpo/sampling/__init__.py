"""The on-device sampler: the engine that samples G completions per prompt (`sampler`), its program (`decode_loop`:
prefill into pages, then decode with continuous batching), its record and state (`state`), the pages it holds
(`pages`), the slot-level interface for multi-turn episodes (`turns`), and how one token is drawn (`methods`).
"""
