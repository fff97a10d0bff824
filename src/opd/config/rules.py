"""The rules that span components, checked once every section has checked its own fields: what an
objective needs against where the batches come from and what each teacher can send, an environment
against the data source, collection ahead against LoRA syncing. Each rule names the setting to
change."""

from __future__ import annotations

from opd.config.defaults import fill_defaults
from opd.config.run import Config
from opd.config.training import TrainingConfig
from opd.errors import ConfigError
from opd.objectives.registry import objective_names
from opd.teachers.config import TeacherConfig


def validate(config: Config) -> Config:
    """Fill the defaults that depend on other settings, then check the rules between sections."""
    training = config.training
    for i, dataset in enumerate(config.datasets):
        if dataset.env is not None and training.data_source == "dataset":
            raise ConfigError(
                f"datasets[{i}].env: training.data_source: dataset gives written completions, "
                "which no environment can answer; use data_source student, teacher or mixed, or "
                "remove env"
            )
    if (
        training.max_staleness
        and config.student.lora_rank
        and config.student.lora_sync == "adapter"
    ):
        raise ConfigError(
            "training.max_staleness: collection ahead samples weights published after each update, "
            "and student.lora_sync: adapter reads the adapter being trained; use lora_sync: merged "
            "or max_staleness: 0"
        )
    if training.reward_coef and training.data_source in ("teacher", "dataset"):
        raise ConfigError(
            "training.reward_coef: rewards the student's own samples, and data_source: "
            f"{training.data_source} gives it none; use data_source student or mixed, or "
            "reward_coef: 0"
        )
    fill_defaults(config)
    for i, dataset in enumerate(config.datasets):
        if training.reward_coef and dataset.group_size == 1 and training.data_source != "dataset":
            raise ConfigError(
                f"datasets[{i}].group_size: training.reward_coef centres each reward within its "
                "prompt's group, and a group of 1 sample makes it 0 on every token; set "
                "group_size to 2 or more (unset with a reward: 4), or reward_coef: 0"
            )
    _check_objective(training)
    _check_mixtures(config)
    for where, teacher in config.teachers():
        if teacher.cross_tokenizer:
            _check_cross_tokenizer_objectives(training, teacher, where)
        if teacher.backend != "local":
            _check_remote_teacher(training, teacher, where)
    return config


def _check_mixtures(config: Config) -> None:
    """A mixture scores the student's samples: it writes no completions (which member would?).
    What each member can send is its own rule (a remote member sends no full distribution)."""
    training = config.training
    for where, teacher in config.teacher_sections():
        if teacher.mixture is None:
            continue
        if training.data_source != "student":
            raise ConfigError(
                f"{where}.mixture: training.data_source '{training.data_source}' has the teacher "
                "write completions, and a mixture only scores them; use data_source: student, or "
                "one teacher"
            )


def _check_remote_teacher(training: TrainingConfig, teacher: TeacherConfig, where: str) -> None:
    """A server sends top-k log-probs at temperature 1, and writes completions only through the
    OpenAI completions route."""
    by_source = training.objectives_by_source()
    for source, objective in by_source.items():
        field = _objective_field(training, source)
        if objective.teacher_signal == "distribution":
            raise ConfigError(
                f"{field}: '{objective.name}' needs the teacher's full distribution, which {where} "
                f"(backend '{teacher.backend}') does not send; use "
                f"{' or '.join(objective_names(teacher_signal='topk'))}, or a local teacher"
            )
        if objective.teacher_signal == "topk" and training.temperature != 1.0:
            raise ConfigError(
                "training.temperature: remote servers send top-k log-probs at temperature 1; "
                f"{objective.name} with a remote teacher needs temperature: 1.0"
            )
    if "teacher" in by_source and teacher.backend != "openai":
        raise ConfigError(
            f"training.data_source: '{training.data_source}' has the teacher write completions, "
            f"which {where} (backend '{teacher.backend}') cannot: a remote teacher samples through "
            "the OpenAI completions route (backend: openai; vLLM, SGLang's OpenAI server or opd "
            "serve)"
        )


def _objective_field(training: TrainingConfig, source: str) -> str:
    """The setting that names the objective of ``source``'s batches."""
    if source != "student" and training.off_policy_objective is not None:
        return "training.off_policy_objective"
    return "training.objective"


def _check_cross_tokenizer_objectives(
    training: TrainingConfig, teacher: TeacherConfig, where: str
) -> None:
    """A teacher with another tokenizer scores sampled text: log-probs of the student's samples, or
    its likely next tokens mapped onto the student's (from the ``character_topk`` it is asked for),
    or nothing (the student learns the teacher's own text by its likelihood)."""
    for source, objective in training.objectives_by_source().items():
        field = _objective_field(training, source)
        if source == "student" and objective.teacher_signal == "topk":
            if not teacher.character_topk:
                raise ConfigError(
                    f"{where}.character_topk: {field} '{objective.name}' reads the teacher's "
                    "likely tokens in the student's; set character_topk > 0 (e.g. 20)"
                )
            if training.temperature != 1.0:
                raise ConfigError(
                    "training.temperature: a cross_tokenizer teacher's likely tokens are read at "
                    f"temperature 1; {objective.name} with it needs temperature: 1.0"
                )
            continue
        wanted = "logprobs" if source == "student" else "none"
        if objective.teacher_signal == wanted:
            continue
        if source == "student":
            served = [
                *objective_names(teacher_signal="logprobs"),
                *objective_names(teacher_signal="topk"),
            ]
            raise ConfigError(
                f"{where}.cross_tokenizer: on the student's samples it serves objective "
                f"{' or '.join(served)}; {field} '{objective.name}' needs the teacher's full "
                "distribution over the student's vocabulary"
            )
        fix = (
            "training.off_policy_objective: nll (the student learns the teacher's text)"
            if training.data_source == "mixed"
            else "training.objective: nll"
        )
        raise ConfigError(
            f"{where}.cross_tokenizer: on the teacher's own samples ({training.data_source}) the "
            f"student learns the text the teacher wrote; {field} '{objective.name}' needs the "
            f"teacher's answer in the student's token ids; set {fix}"
        )


def _check_objective(training: TrainingConfig) -> None:
    """Each objective can learn from the completions it is given, and no setting it ignores is
    set."""
    source = training.data_source
    for batch_source, objective in training.objectives_by_source().items():
        field = _objective_field(training, batch_source)
        if objective.samples == "student" and batch_source != "student":
            off_policy = objective_names(samples="any") + objective_names(samples="reference")
            works = f"one that works off-policy ({', '.join(off_policy)})"
            fix = (
                f"set training.off_policy_objective to {works}"
                if source == "mixed"
                else f"use data_source: student, or {works}"
            )
            raise ConfigError(
                f"training.data_source: '{source}' gives batches the student did not sample, but "
                f"{field} '{objective.name}' {objective.samples_reason}; {fix}"
            )
        if objective.samples == "reference" and batch_source == "student":
            fix = (
                "use data_source: teacher or dataset, or name it in training.off_policy_objective "
                "(the teacher's steps only)"
                if source == "mixed"
                else "use data_source: teacher or dataset"
            )
            raise ConfigError(
                f"training.data_source: '{source}' includes student samples, and {field} "
                f"'{objective.name}' on them {objective.samples_reason}; {fix}"
            )
    objective = training.objective
    ignored = [] if objective.uses_advantages else training.policy_gradient_keys_set()
    if ignored:
        raise ConfigError(
            f"training.{ignored[0]}: shapes the advantages of a policy-gradient objective "
            f"({', '.join(objective_names(uses_advantages=True))}); objective '{objective.name}' "
            "has none, so it would be ignored: remove it"
        )
