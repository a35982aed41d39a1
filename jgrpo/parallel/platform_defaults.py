"""Choices that default by hardware: a config field set to "auto" resolves by the platform of the mesh's devices
("cpu", "tpu", "gpu"; a deviceless TPU topology is "tpu"). The tables live beside what they choose (attention,
decode layers, draws); their measured reasons are in docs/configuration.md."""

from __future__ import annotations

from collections.abc import Mapping


def resolve(field: str, choice: str, choices: tuple[str, ...], auto: Mapping[str, str], platform: str) -> str:
    """`choice` if it is one of `choices`; for "auto", `auto[platform]` (`auto["other"]` for other platforms)."""
    if choice == "auto":
        return auto.get(platform, auto["other"])
    if choice not in choices:
        raise ValueError(f"{field} must be auto or one of {choices}, got '{choice}'")
    return choice
