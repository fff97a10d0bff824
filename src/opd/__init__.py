"""opd: on-policy distillation of language models."""

from opd.config import Config, ConfigError, config_from_dict, load_config
from opd.trainer.loop import TrainResult, train

__all__ = ["Config", "ConfigError", "TrainResult", "config_from_dict", "load_config", "train"]
__version__ = "0.1.0"
