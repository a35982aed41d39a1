"""The training loop and what it owns: the trainer (`trainer`), the jitted step functions (`steps`), the optimiser
(`optimizer`), checkpoints (`checkpoint`, content hashes in `fingerprint`), the checks before a model loads
(`preflight`), one iteration's metrics record (`iteration_record`) and the metrics sinks (`metrics_log`).
"""
