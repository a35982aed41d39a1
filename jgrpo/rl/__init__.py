"""The reinforcement-learning math, pure functions of arrays: group advantages (`advantages`), the GRPO objectives
(`objectives`), off-policy corrections (`corrections`), diagnostics and the paper's Theorem 1 (`diagnostics`),
per-token log-probs (`logprobs`), and when the behaviour policy refreshes (`behaviour_refresh`).
"""
