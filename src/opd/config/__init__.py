"""The run configuration: typed, documented where declared, checked where declared.

A YAML file maps onto :class:`Config`; ``dotted.key=value`` overrides from the command line
are applied before it is built. Each section checks its own fields as it is built
(the ``student`` section, :class:`opd.sampling.engines.StudentSection`: the model's settings and
each rollout engine's beside the engine; :class:`opd.teachers.TeacherConfig`,
:class:`DatasetConfig`, the sections of :class:`TrainingConfig`, every objective and environment
in its own module);
:mod:`opd.config.rules` holds only the rules between sections. Unknown keys, wrong types and
out-of-range values raise :class:`ConfigError` naming the field (and a close spelling when there
is one).

    parsing   a mapping into typed dataclasses, each section's ``problems()`` on the way
    defaults  the defaults that depend on other settings, kept on resume
    rules     the checks between sections
    loading   YAML files, overrides, and the round trip back to a mapping
"""

from opd.config.datasets import DatasetConfig
from opd.config.defaults import FULL_LEARNING_RATE, LORA_LEARNING_RATE
from opd.config.loading import (
    apply_overrides,
    config_from_dict,
    config_to_dict,
    load_config,
    recorded_config,
)
from opd.config.run import RUN_CONFIG_NAME, Config
from opd.config.training import LambdaSchedule, TrainingConfig
from opd.errors import ConfigError
from opd.policy.config import StudentConfig
from opd.sampling.engines import StudentSection
from opd.teachers.config import TeacherConfig

__all__ = [
    "FULL_LEARNING_RATE",
    "LORA_LEARNING_RATE",
    "RUN_CONFIG_NAME",
    "Config",
    "ConfigError",
    "DatasetConfig",
    "LambdaSchedule",
    "StudentConfig",
    "StudentSection",
    "TeacherConfig",
    "TrainingConfig",
    "apply_overrides",
    "config_from_dict",
    "config_to_dict",
    "load_config",
    "recorded_config",
]
