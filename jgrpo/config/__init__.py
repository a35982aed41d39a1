"""The run's configuration: typed, frozen sections (`sections`, the grpo section in `grpo`), loading from YAML and
dotted overrides (`loading`), the generated field table of docs/configuration.md (`docs`), and the errors every
room raises for bad input (`errors`). The lowest room: it imports no other part of jgrpo.

`from jgrpo.config import Config, SamplerConfig, ConfigError` is how the rest of jgrpo names them.
"""

from jgrpo.config.env import EnvConfig
from jgrpo.config.errors import ConfigError, DataError, PathError, RewardSetupError, UserError
from jgrpo.config.grpo import GRPOConfig
from jgrpo.config.sections import (
    CheckpointConfig,
    Config,
    DataConfig,
    LoggingConfig,
    LoraConfig,
    MeshConfig,
    ModelConfig,
    OptimConfig,
    RewardConfig,
    RolloutConfig,
    RunConfig,
    SamplerConfig,
)

__all__ = ["CheckpointConfig", "Config", "ConfigError", "DataConfig", "DataError", "EnvConfig", "GRPOConfig",
           "LoggingConfig", "LoraConfig", "MeshConfig", "ModelConfig", "OptimConfig", "PathError", "RewardConfig",
           "RewardSetupError", "RolloutConfig", "RunConfig", "SamplerConfig", "UserError"]
