"""What researchers report from n samples per prompt: pass@k and maj@k.

- **pass@k**, the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on Code"):
  with c correct among n >= k samples, the chance that k of them drawn without replacement hold at least one
  correct, `1 - C(n-c, k) / C(n, k)`. Averaged over prompts. Using all n samples gives a lower-variance estimate
  than looking at the first k only; pass@1 is c / n.
- **maj@k**, majority voting (self-consistency, Wang et al. 2022): the extracted, normalised answers of the first k
  samples vote; the prompt counts as solved when the winning answer is correct. A tie goes to the answer whose
  first occurrence comes first; samples without an extracted answer do not vote, and a prompt where none has one
  counts as wrong.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one prompt with `c` correct samples out of `n` (requires 1 <= k <= n)."""
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every draw of k holds a correct one
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority_index(answers: Sequence[str | None]) -> int | None:
    """The index of the first sample that gives the most frequent answer (ties: the answer seen first), or None
    when no sample has an answer."""
    counts: dict[str, int] = {}
    first: dict[str, int] = {}
    for i, answer in enumerate(answers):
        if answer is None:
            continue
        counts[answer] = counts.get(answer, 0) + 1
        first.setdefault(answer, i)
    if not counts:
        return None
    winner = max(counts, key=lambda a: (counts[a], -first[a]))
    return first[winner]


def maj_at_k(answers: Sequence[str | None], correct: Sequence[bool], k: int) -> float:
    """1.0 when the majority answer of the first `k` samples is correct, else 0.0 (`answers[i]` is sample i's
    extracted answer or None, `correct[i]` whether sample i is correct)."""
    if not 1 <= k <= len(answers) or len(answers) != len(correct):
        raise ValueError(f"maj@{k} needs k <= the {len(answers)} samples, with as many correctness flags "
                         f"({len(correct)})")
    winner = majority_index(answers[:k])
    return float(winner is not None and bool(correct[winner]))


def summed_over_prompts(correct: np.ndarray, answers: Sequence[str | None] | None, ks: Sequence[int]) -> dict:
    """{"pass_at_k": sum over prompts, "maj_at_k": ...} for each k of `ks`: `correct` [prompts, n] bool, `answers`
    the prompt-major extracted answers of the prompts * n samples (None: no maj@k). Sums, so that batches and
    processes add up; divide by the prompts."""
    prompts, n = correct.shape
    sums = {f"pass_at_{k}": sum(pass_at_k(n, int(c), k) for c in correct.sum(axis=1)) for k in ks}
    if answers is not None:
        sums.update({f"maj_at_{k}": sum(maj_at_k(answers[i * n:(i + 1) * n], correct[i], k) for i in range(prompts))
                     for k in ks})
    return sums


def summed_by_label(correct: np.ndarray, answers: Sequence[str | None] | None, ks: Sequence[int],
                    labels: Sequence[str]) -> dict:
    """summed_over_prompts per label, plus each label's prompts and correct samples: {"LABEL/prompts": ...,
    "LABEL/correct": ..., "LABEL/pass_at_k": ..., "LABEL/maj_at_k": ...} for each label of `labels` (one per
    prompt, e.g. "held_out/True"). Sums, like summed_over_prompts."""
    n = correct.shape[1]
    sums = {}
    for label in sorted(set(labels)):
        rows = [i for i, other in enumerate(labels) if other == label]
        picked = None if answers is None else [answers[i * n + j] for i in rows for j in range(n)]
        part = {"prompts": len(rows), "correct": int(correct[rows].sum()),
                **(summed_over_prompts(correct[rows], picked, ks) if ks else {})}
        sums.update({f"{label}/{name}": value for name, value in part.items()})
    return sums
