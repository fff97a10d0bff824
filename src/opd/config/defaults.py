"""The defaults that depend on other settings (the learning rate on LoRA, the objective on the
teachers and the policy-gradient settings), and the rule that a resumed run keeps the value its
``config.yaml`` recorded, so a change of opd's defaults never changes a run halfway."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any

import yaml

from opd.config.parsing import build_objective
from opd.config.run import RUN_CONFIG_NAME, Config
from opd.config.training import TrainingConfig
from opd.distributed import launched_world
from opd.errors import ConfigError
from opd.objectives.base import Objective
from opd.objectives.registry import objectives
from opd.objectives.rollout_correction import RolloutCorrection
from opd.teachers.config import TeacherConfig

LORA_LEARNING_RATE = 1e-3
"""The default learning rate of a LoRA student (rank 32, alpha = rank)."""
FULL_LEARNING_RATE = 3e-5
"""The default learning rate of a fully fine-tuned student."""
DEFAULT_TOPK = 20
"""The unset objective's top-k: vLLM's default ``--max-logprobs``, so a stock server can serve
it."""
SAMPLES_PER_STEP = 16
"""The samples a dataset gives each step when its batch shape is unset."""
REWARD_GROUP_SIZE = 4
"""The unset group size when the task's reward is in the advantage: its centring needs a group."""
MISMATCH_CORRECTION = RolloutCorrection("truncate", "token", 2.0)
"""The unset rollout correction where the sampler is not the trainer's own forward: on the lab's
chain task with the sampler's log-probs off by noise, it kept the matched run's accuracy where
the uncorrected loss lost 3-7 points, and it changes nothing when they agree
(docs/objectives.md)."""


def objective_mapping(objective: Objective) -> dict:
    """An objective as a config writes it: ``{name: ..., option: value, ...}``."""
    return {"name": objective.name, **dataclasses.asdict(objective)}


def fill_defaults(config: Config) -> None:
    """Set the unset learning rate, objective and batch shape: what the resumed run recorded, else
    today's default."""
    training = config.training
    recorded = _recorded_config(config)
    resumed = recorded.get("training") if isinstance(recorded.get("training"), dict) else {}
    _fill_batch_shapes(config, recorded.get("datasets"))
    if training.learning_rate is None:
        default = LORA_LEARNING_RATE if config.student.lora_rank else FULL_LEARNING_RATE
        training.learning_rate = _kept_or_default(config, resumed, "learning_rate", default)
        if training.learning_rate <= 0:
            raise ConfigError(f"training.learning_rate: must be > 0, got {training.learning_rate}")
    if training.rollout_correction is False:
        training.rollout_correction = "off"  # YAML 1.1 reads a bare off as false
    if training.rollout_correction is None:
        training.rollout_correction = _kept_correction(config, resumed)
    if training.objective is None:
        default = _default_objective(training, [teacher for _, teacher in config.teachers()])
        training.objective = _kept_or_default(config, resumed, "objective", default)
        if training.data_source == "mixed" and training.objective.samples == "student":
            # the unset objective learns from the student's samples only: the teacher's are learnt
            # as text
            training.off_policy_objective = training.off_policy_objective or objectives()["nll"]()


def _fill_batch_shapes(config: Config, recorded: Any) -> None:
    """Each dataset's unset ``group_size`` (1; ``REWARD_GROUP_SIZE`` with a reward in the advantage)
    and ``groups_per_batch`` (``SAMPLES_PER_STEP`` samples a step): the peers' on-policy
    distillation samples one completion a prompt, and on the lab's tasks 32 prompts x 1 sample ended
    far ahead of 8 x 4 (docs/quality.md). A resumed run keeps the shape its config recorded."""
    recorded = recorded if isinstance(recorded, list) else []
    for index, dataset in enumerate(config.datasets):
        kept = (
            recorded[index] if index < len(recorded) and isinstance(recorded[index], dict) else {}
        )
        if dataset.group_size is None:
            default = REWARD_GROUP_SIZE if config.training.reward_coef else 1
            dataset.group_size = _kept_shape(config, kept, index, "group_size", default)
        if dataset.groups_per_batch is None:
            default = max(SAMPLES_PER_STEP // dataset.group_size, 1)
            dataset.groups_per_batch = _kept_shape(config, kept, index, "groups_per_batch", default)


def _kept_shape(config: Config, recorded: dict, index: int, key: str, default: int) -> int:
    """An unset ``datasets[index].<key>``: what the resumed run recorded (said when it differs from
    today's default), else the default."""
    kept = recorded.get(key)
    if kept is None:
        return default
    where = f"{Path(config.log_path) / RUN_CONFIG_NAME}: datasets[{index}].{key}"
    if isinstance(kept, bool) or not isinstance(kept, int) or kept < 1:
        raise ConfigError(f"{where}: expected an integer >= 1, got {kept!r}")
    if kept != default:
        _say_kept(config, f"datasets[{index}].{key}", kept, default)
    return kept


def _say_kept(config: Config, setting: str, shown: Any, default_shown: Any) -> None:
    """Say, from the first process only (every ``torchrun`` worker loads the config), that a
    resumed run keeps a recorded value where today's default differs."""
    if launched_world().is_main:
        warnings.warn(
            f"{config.log_path}: resuming its run with {setting} {shown}, as recorded in its "
            f"{RUN_CONFIG_NAME}; a new run's default is {default_shown} (docs/defaults.md). Set "
            f"{setting} to change it",
            stacklevel=4,
        )


def _recorded_config(config: Config) -> dict:
    """The config recorded by the run this config resumes (empty: it resumes none)."""
    path = Path(config.log_path) / RUN_CONFIG_NAME
    if config.on_existing_log_path != "resume" or not path.is_file():
        return {}
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
        raise ConfigError(
            f"{path}: the run to resume has an unreadable config ({error}); use another log_path, "
            "or on_existing_log_path: overwrite to start over"
        ) from None
    return data if isinstance(data, dict) else {}


def _kept_or_default(config: Config, recorded: dict, key: str, default: Any) -> Any:
    """An unset ``training.<key>``: what the resumed run recorded, so that a change of opd's
    defaults does not change a run halfway (said when it differs from today's, by the first
    process only: every ``torchrun`` worker loads the config), else the default."""
    if recorded.get(key) is None:
        return default
    where = f"{Path(config.log_path) / RUN_CONFIG_NAME}: training.{key}"
    if key == "objective":
        kept = build_objective(recorded[key], where)
        shown, default_shown = objective_mapping(kept), objective_mapping(default)
    else:
        kept = recorded[key]
        if isinstance(kept, bool) or not isinstance(kept, int | float):
            raise ConfigError(f"{where}: expected a number, got {kept!r}")
        kept, shown, default_shown = float(kept), kept, default
    if kept != default:
        _say_kept(config, f"training.{key}", shown, default_shown)
    return kept


def _kept_correction(config: Config, recorded: dict) -> RolloutCorrection | str:
    """An unset ``training.rollout_correction``: the resumed run's, else on where the sampler is not
    the trainer's own forward (vLLM, a server, another dtype), where the two can disagree."""
    student = config.student
    differs = student.sampler != "hf" or student.sampling_dtype is not None
    default = MISMATCH_CORRECTION if differs else "off"
    kept = recorded.get("rollout_correction")
    kept = "off" if kept is False else kept
    if kept is None and recorded:
        kept = "off"  # a run recorded before the setting existed trained uncorrected: it goes on so
    if kept is None:
        return default
    where = f"{Path(config.log_path) / RUN_CONFIG_NAME}: training.rollout_correction"
    if kept != "off":
        if not isinstance(kept, dict):
            raise ConfigError(f"{where}: expected a mapping or off, got {kept!r}")
        try:
            kept = RolloutCorrection(**kept)
        except TypeError as error:
            raise ConfigError(f"{where}: {error}") from None
    if kept != default:
        shown = kept if kept == "off" else dataclasses.asdict(kept)
        _say_kept(
            config,
            "training.rollout_correction",
            shown,
            default if default == "off" else dataclasses.asdict(default),
        )
    return kept


def _default_objective(training: TrainingConfig, teachers: list[TeacherConfig]) -> Objective:
    """The objective of a config that names none: the top-k forward KL where it can serve, which
    tells a student that is far from its teacher which token to write, where the sampled-token
    reverse KL only says which ones not to (docs/defaults.md); otherwise the reverse KL."""
    remote_off_temperature = training.temperature != 1.0 and any(
        t.backend != "local" for t in teachers
    )
    if (
        training.policy_gradient_keys_set()
        or remote_off_temperature
        or any(t.cross_tokenizer for t in teachers)
    ):
        return objectives()["sampled_reverse_kl"]()
    return objectives()["topk_forward_kl"](topk=DEFAULT_TOPK)
