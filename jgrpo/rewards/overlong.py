"""DAPO's soft overlong punishment (arXiv 2503.14476 eq. 13), measured in generated tokens.

A completion is free up to L - buffer tokens (L = sampler.max_new_tokens); past that it loses reward linearly,
`penalty` in all at L. The sampler never generates more than L tokens, so DAPO's "-1 beyond L" is the value at L.
"""

from __future__ import annotations

import numpy as np


def overlong_punishment(lengths, *, max_new_tokens: int, buffer: int, penalty: float) -> np.ndarray:
    """[R] float32 rewards <= 0 for completions of `lengths` generated tokens (0 up to L - buffer)."""
    if not 0 < buffer <= max_new_tokens:
        raise ValueError(f"reward.overlong_buffer={buffer} must be in [1, sampler.max_new_tokens={max_new_tokens}]")
    excess = np.clip(np.asarray(lengths, np.float32) - (max_new_tokens - buffer), 0.0, float(buffer))
    return (-penalty * excess / buffer).astype(np.float32)
