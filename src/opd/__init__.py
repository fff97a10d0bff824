"""opd: on-policy distillation of language models."""

from opd.config import Config, ConfigError, config_from_dict, load_config

__all__ = ["Config", "ConfigError", "TrainResult", "config_from_dict", "load_config", "train"]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """`opd.train` and `opd.TrainResult` on first use: the trainer imports peft and transformers
    (seconds), which `opd --help` and a config check have no need of."""
    if name in ("train", "TrainResult"):
        from opd.trainer import loop

        return getattr(loop, name)
    raise AttributeError(f"module 'opd' has no attribute {name!r}")
