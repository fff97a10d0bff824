"""The run configuration: typed, documented where declared, validated on load.

A YAML file maps onto :class:`Config`; ``dotted.key=value`` overrides from the command line
are applied before validation. Unknown keys, wrong types and out-of-range values raise
:class:`ConfigError` naming the field (and a close spelling when there is one). Each part is
declared beside the component it configures: :class:`opd.policy.StudentConfig`,
:class:`opd.teachers.TeacherConfig`, and every objective's options in its own module
(``training.objective: {name: jsd, beta: 0.5}``, or the bare name for the defaults).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import types
import typing
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from opd.data.tables import PROMPT_KEYS, is_table_source
from opd.distributed import launched_world
from opd.envs.registry import EnvConfig, parse_env_config
from opd.errors import ConfigError
from opd.locations import device_problem, missing_path_problem, url_problem
from opd.objectives.base import Objective
from opd.objectives.policy_losses import LOSS_FN_CONFIG_KEYS
from opd.objectives.registry import objective_names, objectives
from opd.policy.config import StudentConfig
from opd.sampling.vllm_settings import student_settings_problems
from opd.secrets import redact_values
from opd.teachers.config import TeacherConfig

__all__ = [
    "Config",
    "ConfigError",
    "DatasetConfig",
    "StudentConfig",
    "TeacherConfig",
    "TrainingConfig",
    "config_from_dict",
    "config_to_dict",
    "load_config",
    "recorded_config",
]


LORA_LEARNING_RATE = 1e-3
"""The default learning rate of a LoRA student (rank 32, alpha = rank)."""
FULL_LEARNING_RATE = 3e-5
"""The default learning rate of a fully fine-tuned student."""
RUN_CONFIG_NAME = "config.yaml"
"""The resolved config a run writes in its ``log_path``."""


@dataclass
class DatasetConfig:
    """One prompt source. Every step takes ``groups_per_batch`` prompts from each dataset."""

    name: str
    """Used in metric names (``teacher_kl/<name>``) and example printouts."""
    source: str
    """A JSONL file: one ``{"prompt": ...}`` or ``{"messages": [...]}`` object per line,
    optionally with an ``answer``; ``demo:<task>`` or ``reasoning_gym:<task>`` for a generated
    task; or a table: ``hf:<owner>/<name>`` (a Hugging Face dataset, streamed), a directory
    written by ``datasets``' ``save_to_disk``, or a ``.parquet`` file (see ``split``, ``fields``)."""
    groups_per_batch: int = 4
    """Prompts per step from this dataset."""
    group_size: int = 4
    """Samples drawn per prompt."""
    teacher: TeacherConfig | None = None
    """A teacher for this dataset only; defaults to the top-level ``teacher``."""
    num_prompts: int | None = None
    """Use only the first N prompts of a file, or generate N for a generated source (default 2000)."""
    task_config: dict[str, Any] = field(default_factory=dict)
    """Options of a ``reasoning_gym:<task>`` generator, e.g. ``{min_terms: 2, max_terms: 2}``."""
    eval_source: str | None = None
    """Held-out prompts; defaults to the ``@test`` split of a generated source, to ``eval_split`` of
    a dataset's table, none for files."""
    eval_num_prompts: int = 64
    """Held-out prompts used per evaluation."""
    split: str = "train"
    """Tables (``hf:<owner>/<name>``, a ``save_to_disk`` directory, a Parquet file): the split
    prompts come from."""
    eval_split: str | None = None
    """Tables: the split held-out prompts come from (of ``eval_source``, else of ``source``)."""
    subset: str | None = None
    """``hf:`` datasets with several configurations: which one (``main`` for ``openai/gsm8k``)."""
    fields: dict[str, str] = field(default_factory=dict)
    """Tables: the column each prompt key is read from, e.g. ``{prompt: question, answer: answer}``
    (keys: ``prompt`` or ``messages``, ``answer``, ``completion``, ``metadata``); unmapped keys are
    read from columns of their own name."""
    grader: Literal["auto", "exact_match", "last_number", "reasoning_gym", "none"] = "auto"
    """How answers are scored: ``auto`` is the task's scorer for reasoning-gym, exact match otherwise."""
    env: EnvConfig | None = None
    """Multi-turn episodes: the environment that answers each student turn (a tool's result, a
    user's reply) until the episode ends: ``calculator``, ``retry`` or ``my_pkg.envs:MyEnv``, with
    ``max_turns``, ``max_episode_tokens`` and its own options beside the name (docs/environments.md).
    The teacher scores only the student's turns. Unset: one turn per prompt."""


@dataclass(frozen=True)
class LambdaSchedule:
    """``training.lmbda`` that moves during the run: the chance that a step's batch is the student's
    own goes from ``start`` to ``end`` over the first ``steps`` steps (``start: 0, end: 1``: the
    teacher's samples first, then more and more of the student's)."""

    start: float = 0.0
    """The share at step 0."""
    end: float = 1.0
    """The share from step ``steps`` on."""
    steps: int = 20
    """Steps the move takes."""
    shape: Literal["linear", "step"] = "linear"
    """``linear``: in a straight line; ``step``: ``start`` until step ``steps``, then ``end``."""

    def at(self, step: int) -> float:
        """The share at step ``step``."""
        if step >= self.steps:
            return self.end
        if self.shape == "step":
            return self.start
        return self.start + (self.end - self.start) * step / self.steps


@dataclass
class TrainingConfig:
    """The optimisation loop."""

    objective: Objective | None = None
    """What the student minimises on each batch: a registered objective's name, or ``{name: ...,
    option: value}`` with that objective's options (each module of ``opd.objectives`` documents
    its own). ``sampled_reverse_kl``: negative per-token reverse KL as the advantage of a
    policy-gradient ``loss_fn``; ``k3``: the differentiable k3 estimate on the sampled tokens
    (``kl_direction``); ``jsd``: full-distribution generalized JSD (``beta``), teacher in process
    only; ``topk_forward_kl``: forward KL over the teacher's ``topk`` tokens plus a tail bucket;
    ``nll``: negative log-likelihood of the tokens (SFT on teacher or dataset completions).
    Unset: ``topk_forward_kl`` with ``topk: 20`` (what a vLLM server sends by default), which
    shows even a far-off student the token the teacher wants; ``sampled_reverse_kl`` with a
    ``cross_tokenizer`` teacher (what its defaults were measured with; its top-k in the student's
    tokens is asked for by name) and where top-k cannot serve: a policy-gradient setting given
    (``kl_penalty_coef``, ``kl_discount_factor``, ``advantage_clip``, ``normalize_advantages``,
    ``advantage_logprobs``, ``loss_fn``, ``loss_fn_config``), or a remote
    teacher with ``temperature`` other than 1 (docs/defaults.md)."""
    data_source: Literal["student", "teacher", "mixed", "dataset"] = "student"
    """Where completions come from: ``student`` samples (on-policy), ``teacher`` samples
    (sequence-level KD), ``mixed`` (on-policy with probability ``lmbda`` per step, else
    teacher), or ``dataset`` (each prompt's ``completion``, else ``answer``; one per prompt)."""
    off_policy_objective: Objective | None = None
    """``mixed`` only: the objective of the steps whose batch the teacher wrote (``objective``
    then applies to the student's own steps); unset: ``objective`` on both, or ``nll`` where an
    unset ``objective`` becomes ``sampled_reverse_kl`` (which learns from the student's samples
    only). ``nll`` here lets a teacher that scores only sampled tokens (``cross_tokenizer``)
    start the student on its own episodes, with ``sampled_reverse_kl`` on the student's."""
    lmbda: float | LambdaSchedule = 0.5
    """``mixed`` only: the chance that a step's batch is the student's own samples, else the
    teacher's (GKD's lambda), drawn per step from the run's seed; or a schedule,
    ``{start: 0, end: 1, steps: 20, shape: linear}``, that moves it over the run (logged per
    step as ``lmbda``)."""
    learning_rate: float | None = None
    """Peak learning rate, reached after ``warmup_steps``. Unset: 1e-3 with LoRA, 3e-5 for full
    fine-tuning (``student.lora_rank: 0``), from a sweep on a 135M student (docs/defaults.md);
    larger models usually want lower rates."""
    warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0 to ``learning_rate``."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """After warmup: hold ``learning_rate`` (``constant``), or decay it towards 0 at the run's
    last optimizer step (the run's steps x ``num_substeps``) in a straight line (``linear``, as
    Hugging Face's Trainer does by default) or along a half cosine (``cosine``)."""
    max_tokens: int = 64
    """Most tokens sampled per completion."""
    temperature: float = 1.0
    """Sampling temperature; the student's log-probs in the loss use the same temperature."""
    kl_penalty_coef: float = 1.0
    """Objectives with advantages: weight of the negative reverse KL in the per-token advantage."""
    kl_discount_factor: float = 0.0
    """Objectives with advantages: when > 0, each token's advantage becomes the discounted sum of
    the advantages after it."""
    advantage_clip: float | None = None
    """Objectives with advantages: clamp each token's advantage (after any discount) to
    ``[-advantage_clip, advantage_clip]``, so tokens the teacher rules out (tens of nats) do not
    outweigh the rest of the batch; None leaves them as they are."""
    normalize_advantages: bool = False
    """Objectives with advantages: subtract the batch's mean advantage and divide by its standard
    deviation (over every completion token of the whole batch, on every process; after any
    discount and clip), so the step sees a baseline and a scale that do not depend on how far
    the student is from the teacher. The logged ``advantage/*`` stay the unnormalised nats."""
    advantage_logprobs: Literal["behaviour", "current"] | None = None
    """Objectives with advantages: the student log-probs the reverse-KL advantage is built from.
    ``behaviour``: those recorded by the sampler (the tinker recipe); ``current``: each sampled
    token's log-prob under the weights about to be updated, from one no-grad forward before the
    update (an extra forward a step), the remedy for stale samples (asynchronous on-policy
    distillation, NOTES.md section 6). The importance ratio of the policy loss stays against the
    behaviour log-probs either way. Unset: ``current`` where ``max_staleness`` > 0 (samples four
    updates stale otherwise undo the run: docs/distributed.md), else ``behaviour``."""
    loss_fn: Literal["importance_sampling", "ppo", "cispo", "dro"] = "importance_sampling"
    """Objectives with advantages: the policy loss on the sampled tokens (formulas in
    ``opd.objectives.policy_losses``)."""
    loss_fn_config: dict[str, float] = field(default_factory=dict)
    """Knobs of ``loss_fn``: ``clip_low_threshold`` / ``clip_high_threshold`` (ppo, cispo), ``beta`` (dro)."""
    loss_aggregation: Literal["token_mean", "sequence_mean", "sum"] = "token_mean"
    """``sum`` over tokens as the reference does, or a mean that transfers across batch sizes."""
    num_substeps: int = 1
    """Optimizer steps per batch, each on a contiguous slice of the sequences."""
    micro_batch_size: int | None = None
    """Most sequences per forward/backward inside a substep (gradient accumulation). Without
    ``micro_batch_tokens``: runs of this many rows in batch order (None: one micro-batch)."""
    micro_batch_tokens: int | None = None
    """Most tokens (prompt + completion, padding not counted when ``packing``) per forward /
    backward: each substep's rows are binned by length, longest first, into as few micro-batches
    as fit (the same bins for the same rows, on resume and on any number of processes; a process
    with fewer bins than another splits its largest). Unset: sized for the device when the run
    starts, about a quarter of its memory for activations (estimated from the model's shape;
    ``opd train --dry-run`` prints it), unless ``micro_batch_size`` is set. The number of
    micro-batches changes no number the update computes beyond rounding (the loss is normalised
    by the whole batch's token and sequence counts). Must hold the longest possible row: the
    longest prompt plus ``max_tokens``."""
    packing: bool = True
    """Run each micro-batch's sequences as one padding-free row (position ids restarting per
    sequence, attention within each; flash-attention varlen on GPUs, sdpa per sequence
    otherwise), in the update, the current log-probs and a local teacher's forward. A model
    whose attention cannot pack (not sdpa or flash attention, sliding windows without flash
    attention) runs padded, said once. False pads every micro-batch to its longest row."""
    max_steps: int | None = None
    """Stop after this many steps; None runs one pass over the shortest dataset (more: each
    dataset starts another pass, reshuffled, when it runs out)."""
    max_grad_norm: float | None = 1.0
    """Clip the gradient's global norm; None disables clipping."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.95
    """AdamW beta2."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    autocast: Literal["bfloat16"] | None = None
    """Mixed precision for the update: the student's transformer body runs forward and backward
    under ``torch.autocast`` in this dtype, while weights, gradients, optimizer state, the lm
    head and the log-probs stay in the weights' dtype (float32 on a CPU). Faster where bfloat16
    matmuls are (GPUs; CPUs with avx512_bf16 or AMX), slower on CPUs without them, and far
    slower on a CPU without AVX-512 (opd warns). Rollouts, teacher
    and evaluation are untouched (see ``student.sampling_dtype``, ``teacher.dtype``). float16
    is not offered: it needs loss scaling."""
    logprob_chunk_size: int = 1024
    """Positions whose logits exist at once when computing log-probs (memory vs speed)."""
    teacher_batch_size: int = 32
    """Most sequences per forward of a local teacher (also at most ``micro_batch_tokens`` tokens)."""
    show_examples: bool = False
    """Print one coloured sample per dataset per step (prompt, trained tokens, per-token KL)."""
    parallel: Literal["auto", "none", "ddp", "fsdp"] = "auto"
    """How several processes (``torchrun --nproc_per_node N``) share the student: ``ddp`` keeps a
    whole copy per process and averages gradients; ``fsdp`` shards weights, gradients and optimizer
    state across them (PyTorch FSDP2, ``fully_shard`` per transformer block); ``auto`` is none for
    one process and fsdp for several. Each process samples, scores and learns from its share of
    every step's groups; the update equals one process's on the whole batch."""
    dist_backend: Literal["auto", "gloo", "nccl"] = "auto"
    """The torch.distributed backend under torchrun: ``auto`` is nccl on GPUs, gloo on CPUs."""
    dist_timeout_s: float = 1800.0
    """How long a process waits in a collective for the others before the job fails."""
    stop_on_divergence: bool = False
    """Stop the run at the first sign of it going wrong (entropy collapse, teacher KL rising for 5
    steps, ``kl_sample_train`` or the gradient norm exploding, held-out accuracy falling), keeping
    the last checkpoint; otherwise each sign is only warned about, once."""
    max_staleness: int = 0
    """Collect up to this many steps ahead of learning: with k >= 1, the batches of steps
    i+1..i+k are sampled and scored by a background worker (with its own copy of the weights,
    refreshed after every update) while step i learns, so a batch may come from weights up to k
    updates old (its recorded log-probs make the importance ratio correct). 0: the synchronous loop."""

    def objective_for(self, source: str) -> Objective:
        """The objective of a batch written by ``source`` (``student``, ``teacher`` or ``dataset``)."""
        if source == "student" or self.off_policy_objective is None:
            return self.objective
        return self.off_policy_objective

    def objectives_by_source(self) -> dict[str, Objective]:
        """The objective of each source this run's batches come from."""
        sources = {"mixed": ("student", "teacher")}.get(self.data_source, (self.data_source,))
        return {source: self.objective_for(source) for source in sources}

    def lmbda_at(self, step: int) -> float:
        """``lmbda`` at step ``step`` (a schedule's value there, or the constant)."""
        return self.lmbda.at(step) if isinstance(self.lmbda, LambdaSchedule) else self.lmbda

    @property
    def advantage_source(self) -> Literal["behaviour", "current"]:
        """``advantage_logprobs``, or what its unset value means for this run."""
        if self.advantage_logprobs is not None:
            return self.advantage_logprobs
        return "current" if self.max_staleness > 0 else "behaviour"


@dataclass
class Config:
    """A whole run: where it logs, what trains on what, and how."""

    student: StudentConfig
    """The model being trained."""
    teacher: TeacherConfig
    """The default teacher, used by every dataset that names none."""
    datasets: list[DatasetConfig]
    """Prompt sources; each step draws from all of them."""
    log_path: str = "runs/default"
    """Directory for metrics, config and checkpoints."""
    seed: int = 0
    """Seeds data order, sampling and initialisation."""
    save_every: int = 20
    """Checkpoint every N steps (0: only at the end); the end of the run always saves."""
    eval_every: int = 20
    """Evaluate on held-out prompts before every N-th step and after the last (0: never)."""
    on_existing_log_path: Literal["resume", "overwrite", "fail"] = "resume"
    """When ``log_path`` already holds a run: continue from its last checkpoint, start over, or stop."""
    load_checkpoint_path: str | None = None
    """Start a new run from these weights (a checkpoint or model directory) with a fresh optimizer."""
    loggers: list[Literal["tensorboard", "wandb", "mlflow"]] = field(default_factory=list)
    """Where metrics go besides ``metrics.jsonl`` (each needs its package installed)."""
    run_name: str | None = None
    """Run name shown by W&B and MLflow (default: the log_path's folder name)."""
    wandb_project: str | None = None
    """W&B project; the API key is read by wandb from ``WANDB_API_KEY``, never by opd."""
    mlflow_tracking_uri: str | None = None
    """MLflow tracking server or store; default ``<log_path>/mlruns``."""
    trace: bool = False
    """Also write ``trace.json`` (Chrome / Perfetto trace of every phase) at the end of the run."""
    compute_post_kl: bool = False
    """Log ``post_kl``: KL between the policy before and after the step's update, on the step's batch."""
    training: TrainingConfig = field(default_factory=TrainingConfig)
    """The optimisation loop."""

    def teacher_for(self, dataset: DatasetConfig) -> TeacherConfig:
        """The teacher that scores ``dataset``."""
        return dataset.teacher or self.teacher


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


MAX_INT = 2**63 - 1
"""Larger integers are a typo, and would overflow where torch or numpy meet them."""


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Check ``value`` against the annotation ``tp`` (ints widen to floats) and build dataclasses."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in (o for o in options if o is not type(None)):
            try:
                return _coerce(value, option, path)
            except ConfigError as error:
                errors.append(str(error))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{path}: {value!r} matches none of {tp}")
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            hint = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            suggestion = f" (did you mean {hint[0]!r}?)" if hint else ""
            raise ConfigError(f"{path}: {value!r} is not one of {list(choices)}{suggestion}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected a list, got {type(value).__name__} {value!r}")
        (item_type,) = typing.get_args(tp)
        return [_coerce(item, item_type, f"{path}[{i}]") for i, item in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__} {value!r}")
        _, value_type = typing.get_args(tp)
        return {str(k): _coerce(v, value_type, f"{path}.{k}") for k, v in value.items()}
    if tp is Objective:
        return _build_objective(value, path)
    if tp is EnvConfig:
        return parse_env_config(value, path)
    if dataclasses.is_dataclass(tp):
        return _build_dataclass(tp, value, path)
    if tp is Any:
        return value
    if tp is float and isinstance(value, int | float | str) and not isinstance(value, bool):
        try:
            number = float(value)  # YAML 1.1 reads 3e-5 (no dot) as a string
        except (ValueError, OverflowError):
            raise ConfigError(f"{path}: expected float, got {type(value).__name__} {value!r}") from None
        if not math.isfinite(number):
            raise ConfigError(f"{path}: must be a finite number, got {value!r}")
        return number
    if tp is bool and not isinstance(value, bool):
        raise ConfigError(f"{path}: expected true or false, got {value!r}")
    if tp is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{path}: expected an integer, got {value!r}")
    if tp is int and abs(value) > MAX_INT:
        raise ConfigError(f"{path}: {value} is too large (at most {MAX_INT})")
    if not isinstance(value, tp):
        raise ConfigError(f"{path}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
    return value


def _option_owners(key: str) -> list[str]:
    """The registered objectives that have an option called ``key``."""
    return [name for name, cls in objectives().items() if key in {f.name for f in dataclasses.fields(cls)}]


def _build_dataclass(cls: type, data: Any, path: str) -> Any:
    prefix = f"{path}." if path else ""
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping, got {type(data).__name__} {data!r}")
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = [key for key in data if key not in known]
    if unknown:
        key = unknown[0]
        section = next(
            (name for name in known if Objective in (hints[name], *typing.get_args(hints[name]))), None
        )
        owners = _option_owners(str(key)) if section else []
        if owners:
            raise ConfigError(
                f"{prefix}{key}: an option of objective {' or '.join(map(repr, owners))}, set under "
                f"{prefix}{section}: e.g. {section}: {{name: {owners[0]}, {key}: {data[key]!r}}}"
            )
        hint = difflib.get_close_matches(str(key), known, n=1)
        suggestion = f"; did you mean '{prefix}{hint[0]}'?" if hint else f"; known keys: {', '.join(known)}"
        raise ConfigError(f"{prefix}{key}: unknown key{suggestion}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            kwargs[f.name] = _coerce(data[f.name], hints[f.name], f"{prefix}{f.name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{prefix}{f.name}: required key is missing")
    return cls(**kwargs)


def _build_objective(value: Any, path: str) -> Objective:
    """An objective from its name, or from ``{name: ..., option: value, ...}``."""
    if isinstance(value, str):
        name, options = value, {}
    elif isinstance(value, dict):
        if "name" not in value:
            raise ConfigError(f"{path}.name: required key is missing (one of {objective_names()})")
        name, options = value["name"], {k: v for k, v in value.items() if k != "name"}
    else:
        raise ConfigError(
            f"{path}: expected an objective's name or a mapping {{name: ..., options}}, got {value!r}"
        )
    registered = objectives()
    if not isinstance(name, str) or name not in registered:
        hint = difflib.get_close_matches(str(name), list(registered), n=1)
        suggestion = f" (did you mean {hint[0]!r}?)" if hint else ""
        raise ConfigError(f"{path}: {name!r} is not one of {list(registered)}{suggestion}")
    cls = registered[name]
    own = [f.name for f in dataclasses.fields(cls)]
    for key in options:
        owners = _option_owners(str(key))
        if key not in own and owners:
            raise ConfigError(
                f"{path}.{key}: an option of objective {' or '.join(map(repr, owners))}, not of {name!r}"
                f" (its options: {', '.join(own) or 'none'})"
            )
    objective = _build_dataclass(cls, options, path)
    for option, problem in objective.option_problems():
        raise ConfigError(f"{path}.{option}: {problem}")
    return objective


def _positive(value: float | int | None, path: str, *, allow_zero: bool = False) -> None:
    if value is None:
        return
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{path}: must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def validate(config: Config) -> Config:
    """Range and consistency checks that types alone cannot express."""
    if not config.datasets:
        raise ConfigError("datasets: at least one dataset is required")
    names = [d.name for d in config.datasets]
    duplicates = {n for n in names if names.count(n) > 1}
    if duplicates:
        raise ConfigError(f"datasets: names must be unique; repeated: {sorted(duplicates)}")
    for i, dataset in enumerate(config.datasets):
        for key in ("groups_per_batch", "group_size"):
            value = getattr(dataset, key)
            if value < 1:
                raise ConfigError(f"datasets[{i}].{key}: must be >= 1, got {value}")
        _positive(dataset.num_prompts, f"datasets[{i}].num_prompts")
        _positive(dataset.eval_num_prompts, f"datasets[{i}].eval_num_prompts")
        for key, problem in table_option_problems(dataset):
            raise ConfigError(f"datasets[{i}].{key}: {problem}")
    for key, problem in _place_problems(config):
        raise ConfigError(f"{key}: {problem}")
    _positive(config.student.lora_rank, "student.lora_rank", allow_zero=True)
    for key, problem in student_settings_problems(config.student):
        raise ConfigError(f"student.{key}: {problem}")
    _positive(config.save_every, "save_every", allow_zero=True)
    _positive(config.eval_every, "eval_every", allow_zero=True)
    training = config.training
    resumed = _recorded_training(config)
    if training.learning_rate is None:
        default = LORA_LEARNING_RATE if config.student.lora_rank else FULL_LEARNING_RATE
        training.learning_rate = _kept_or_default(config, resumed, "learning_rate", default)
    _positive(training.learning_rate, "training.learning_rate")
    _positive(training.temperature, "training.temperature")
    _positive(training.max_tokens, "training.max_tokens")
    _positive(training.num_substeps, "training.num_substeps")
    _positive(training.micro_batch_size, "training.micro_batch_size")
    _positive(training.micro_batch_tokens, "training.micro_batch_tokens")
    _positive(training.max_steps, "training.max_steps")
    _positive(training.max_grad_norm, "training.max_grad_norm")
    _positive(training.warmup_steps, "training.warmup_steps", allow_zero=True)
    _positive(training.kl_penalty_coef, "training.kl_penalty_coef", allow_zero=True)
    _positive(training.logprob_chunk_size, "training.logprob_chunk_size")
    _positive(training.teacher_batch_size, "training.teacher_batch_size")
    if not 0.0 <= training.kl_discount_factor < 1.0:
        raise ConfigError(
            f"training.kl_discount_factor: must be in [0, 1), got {training.kl_discount_factor}"
        )
    _positive(training.advantage_clip, "training.advantage_clip")
    _positive(training.max_staleness, "training.max_staleness", allow_zero=True)
    _positive(training.dist_timeout_s, "training.dist_timeout_s")
    for i, dataset in enumerate(config.datasets):
        if dataset.env is not None and training.data_source == "dataset":
            raise ConfigError(
                f"datasets[{i}].env: training.data_source: dataset gives written completions, which no "
                "environment can answer; use data_source student, teacher or mixed, or remove env"
            )
    if training.max_staleness and config.student.lora_rank and config.student.lora_sync == "adapter":
        raise ConfigError(
            "training.max_staleness: collection ahead samples weights published after each update, "
            "and student.lora_sync: adapter reads the adapter being trained; use lora_sync: merged "
            "or max_staleness: 0"
        )
    shares = (
        {"lmbda.start": training.lmbda.start, "lmbda.end": training.lmbda.end}
        if isinstance(training.lmbda, LambdaSchedule)
        else {"lmbda": training.lmbda}
    )
    for key, share in shares.items():
        if not 0.0 <= share <= 1.0:
            raise ConfigError(f"training.{key}: must be in [0, 1], got {share}")
    if isinstance(training.lmbda, LambdaSchedule):
        _positive(training.lmbda.steps, "training.lmbda.steps")
    teachers = _teachers(config)
    if training.objective is None:
        default = _default_objective(training, [teacher for _, teacher in teachers])
        training.objective = _kept_or_default(config, resumed, "objective", default)
        if training.data_source == "mixed" and training.objective.samples == "student":
            # the unset objective learns from the student's samples only: the teacher's are learnt as text
            training.off_policy_objective = training.off_policy_objective or objectives()["nll"]()
    _check_objective(training)
    by_source = training.objectives_by_source()
    for where, teacher in teachers:
        _positive(teacher.character_topk, f"{where}.character_topk", allow_zero=True)
        if teacher.cross_tokenizer:
            _check_cross_tokenizer_objectives(training, teacher, where)
            if teacher.backend != "local" and not teacher.tokenizer:
                raise ConfigError(f"{where}.tokenizer: required for cross_tokenizer with a remote teacher")
        if teacher.chat_template_kwargs and not teacher.chat_template:
            raise ConfigError(
                f"{where}.chat_template_kwargs: read by the teacher's own template only; set "
                f"{where}.chat_template (tokenizer, or a Jinja template), or remove them (the teacher "
                "sees the student's rendering, student.chat_template_kwargs included)"
            )
        if teacher.chat_template == "tokenizer" and teacher.backend != "local" and not teacher.tokenizer:
            raise ConfigError(
                f"{where}.tokenizer: required to use the tokenizer's chat template of a remote teacher"
            )
        if teacher.backend == "local":
            continue
        if not teacher.base_url:
            raise ConfigError(f"{where}.base_url: required for backend '{teacher.backend}'")
        for source, objective in by_source.items():
            field = _objective_field(training, source)
            if objective.teacher_signal == "distribution":
                raise ConfigError(
                    f"{field}: '{objective.name}' needs the teacher's full distribution, which "
                    f"{where} (backend '{teacher.backend}') does not send; use "
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
                "the OpenAI completions route (backend: openai; vLLM, SGLang's OpenAI server or opd serve)"
            )
        for key in ("timeout_s", "max_retries", "max_concurrency", "request_batch_size"):
            _positive(getattr(teacher, key), f"{where}.{key}", allow_zero=key == "max_retries")
    allowed = LOSS_FN_CONFIG_KEYS[training.loss_fn]
    for key in training.loss_fn_config:
        if key not in allowed:
            raise ConfigError(
                f"training.loss_fn_config.{key}: not a knob of loss_fn '{training.loss_fn}'"
                f" (it takes: {sorted(allowed) or 'none'})"
            )
    return config


def table_option_problems(dataset: DatasetConfig) -> list[tuple[str, str]]:
    """``(field, problem)`` for table options that cannot apply: a key no prompt has, or options
    given for a source that is no table."""
    problems = [
        (f"fields.{key}", f"not a prompt key; use {', '.join(PROMPT_KEYS)}")
        for key in dataset.fields
        if key not in PROMPT_KEYS
    ]
    if not any(is_table_source(s) for s in (dataset.source, dataset.eval_source) if s):
        given = [key for key in ("fields", "subset", "eval_split") if getattr(dataset, key)]
        given += ["split"] if dataset.split != "train" else []
        problems += [
            (key, f"applies to tables (hf:<dataset>, a save_to_disk directory, a .parquet file), and "
             f"'{dataset.source}' is none")
            for key in given
        ]  # fmt: skip
    return problems


def _place_problems(config: Config) -> list[tuple[str, str]]:
    """``(field, problem)`` for each path, device or URL that cannot be right, found before any
    model loads: a missing local path (with a close match), a device torch has no name for, a
    server URL without a scheme or host."""
    checks: list[tuple[str, str | None, Callable[[str], str | None]]] = [
        ("student.model", config.student.model, missing_path_problem),
        ("student.tokenizer", config.student.tokenizer, missing_path_problem),
        ("student.device", config.student.device, device_problem),
        ("load_checkpoint_path", config.load_checkpoint_path, missing_path_problem),
    ]
    for where, teacher in _teachers(config):
        checks.append((f"{where}.tokenizer", teacher.tokenizer, missing_path_problem))
        if teacher.backend == "local":
            checks += [
                (f"{where}.model", teacher.model, missing_path_problem),
                (f"{where}.device", teacher.device, device_problem),
            ]
        else:
            checks.append((f"{where}.base_url", teacher.base_url, url_problem))
    found = [(key, check(value)) for key, value, check in checks if value]
    return [(key, problem) for key, problem in found if problem]


def _teachers(config: Config) -> list[tuple[str, TeacherConfig]]:
    """Each teacher with the config key it is set at."""
    return [("teacher", config.teacher)] + [
        (f"datasets[{i}].teacher", d.teacher) for i, d in enumerate(config.datasets) if d.teacher
    ]


POLICY_GRADIENT_KEYS = (
    "kl_penalty_coef",
    "kl_discount_factor",
    "advantage_clip",
    "normalize_advantages",
    "advantage_logprobs",
    "loss_fn",
    "loss_fn_config",
)
"""Training settings read only by objectives that learn from advantages."""


DEFAULT_TOPK = 20
"""The unset objective's top-k: vLLM's default ``--max-logprobs``, so a stock server can serve it."""


def _policy_gradient_keys_set(training: TrainingConfig) -> list[str]:
    """The policy-gradient settings given values other than their defaults."""
    defaults = TrainingConfig()
    return [key for key in POLICY_GRADIENT_KEYS if getattr(training, key) != getattr(defaults, key)]


def _recorded_training(config: Config) -> dict:
    """The ``training`` section recorded by the run this config resumes (empty: it resumes none)."""
    path = Path(config.log_path) / RUN_CONFIG_NAME
    if config.on_existing_log_path != "resume" or not path.is_file():
        return {}
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
        raise ConfigError(
            f"{path}: the run to resume has an unreadable config ({error}); "
            "use another log_path, or on_existing_log_path: overwrite to start over"
        ) from None
    training = data.get("training") if isinstance(data, dict) else None
    return training if isinstance(training, dict) else {}


def _kept_or_default(config: Config, recorded: dict, key: str, default: Any) -> Any:
    """An unset ``training.<key>``: what the resumed run recorded, so that a change of opd's
    defaults does not change a run halfway (said when it differs from today's, by the first
    process only: every ``torchrun`` worker loads the config), else the default."""
    if recorded.get(key) is None:
        return default
    where = f"{Path(config.log_path) / RUN_CONFIG_NAME}: training.{key}"
    if key == "objective":
        kept = _build_objective(recorded[key], where)
        shown, default_shown = objective_mapping(kept), objective_mapping(default)
    else:
        kept = recorded[key]
        if isinstance(kept, bool) or not isinstance(kept, int | float):
            raise ConfigError(f"{where}: expected a number, got {kept!r}")
        kept, shown, default_shown = float(kept), kept, default
    if kept != default and launched_world().is_main:
        warnings.warn(
            f"{config.log_path}: resuming its run with training.{key} {shown}, as recorded in its "
            f"{RUN_CONFIG_NAME}; a new run's default is {default_shown} (docs/defaults.md). "
            f"Set training.{key} to change it",
            stacklevel=2,
        )
    return kept


def _default_objective(training: TrainingConfig, teachers: list[TeacherConfig]) -> Objective:
    """The objective of a config that names none: the top-k forward KL where it can serve, which
    tells a student that is far from its teacher which token to write, where the sampled-token
    reverse KL only says which ones not to (docs/defaults.md); otherwise the reverse KL."""
    remote_off_temperature = training.temperature != 1.0 and any(t.backend != "local" for t in teachers)
    if (
        _policy_gradient_keys_set(training)
        or remote_off_temperature
        or any(t.cross_tokenizer for t in teachers)
    ):
        return objectives()["sampled_reverse_kl"]()
    return objectives()["topk_forward_kl"](topk=DEFAULT_TOPK)


def _objective_field(training: TrainingConfig, source: str) -> str:
    """The setting that names the objective of ``source``'s batches."""
    if source != "student" and training.off_policy_objective is not None:
        return "training.off_policy_objective"
    return "training.objective"


def _check_cross_tokenizer_objectives(training: TrainingConfig, teacher: TeacherConfig, where: str) -> None:
    """A teacher with another tokenizer scores sampled text: log-probs of the student's samples, or
    its likely next tokens mapped onto the student's (from the ``character_topk`` it is asked for),
    or nothing (the student learns the teacher's own text by its likelihood)."""
    for source, objective in training.objectives_by_source().items():
        field = _objective_field(training, source)
        if source == "student" and objective.teacher_signal == "topk":
            if not teacher.character_topk:
                raise ConfigError(
                    f"{where}.character_topk: {field} '{objective.name}' reads the teacher's likely tokens "
                    "in the student's; set character_topk > 0 (e.g. 20)"
                )
            if training.temperature != 1.0:
                raise ConfigError(
                    f"training.temperature: a cross_tokenizer teacher's likely tokens are read at "
                    f"temperature 1; {objective.name} with it needs temperature: 1.0"
                )
            continue
        wanted = "logprobs" if source == "student" else "none"
        if objective.teacher_signal == wanted:
            continue
        if source == "student":
            served = [*objective_names(teacher_signal="logprobs"), *objective_names(teacher_signal="topk")]
            raise ConfigError(
                f"{where}.cross_tokenizer: on the student's samples it serves objective "
                f"{' or '.join(served)}; {field} '{objective.name}' needs the teacher's full distribution "
                "over the student's vocabulary"
            )
        fix = (
            "training.off_policy_objective: nll (the student learns the teacher's text)"
            if training.data_source == "mixed"
            else "training.objective: nll"
        )
        raise ConfigError(
            f"{where}.cross_tokenizer: on the teacher's own samples ({training.data_source}) the student "
            f"learns the text the teacher wrote; {field} '{objective.name}' needs the teacher's answer in "
            f"the student's token ids; set {fix}"
        )


def _check_objective(training: TrainingConfig) -> None:
    """Each objective can learn from the completions it is given, and no setting it ignores is set."""
    if training.off_policy_objective is not None and training.data_source != "mixed":
        raise ConfigError(
            "training.off_policy_objective: applies to the teacher's steps of data_source: mixed; with "
            f"'{training.data_source}' training.objective applies to every batch: remove it, or set the "
            "objective there"
        )
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
                f"training.data_source: '{source}' gives batches the student did not sample, but {field} "
                f"'{objective.name}' {objective.samples_reason}; {fix}"
            )
        if objective.samples == "reference" and batch_source == "student":
            fix = (
                "use data_source: teacher or dataset, or name it in training.off_policy_objective "
                "(the teacher's steps only)"
                if source == "mixed"
                else "use data_source: teacher or dataset"
            )
            raise ConfigError(
                f"training.data_source: '{source}' includes student samples, and {field} '{objective.name}' "
                f"on them {objective.samples_reason}; {fix}"
            )
    objective = training.objective
    ignored = [] if objective.uses_advantages else _policy_gradient_keys_set(training)
    if ignored:
        raise ConfigError(
            f"training.{ignored[0]}: shapes the advantages of a policy-gradient objective "
            f"({', '.join(objective_names(uses_advantages=True))}); objective '{objective.name}' "
            "has none, so it would be ignored: remove it"
        )


def parse_override(override: str) -> tuple[list[str], Any]:
    """``a.b.c=value`` -> (["a", "b", "c"], YAML-parsed value)."""
    if "=" not in override:
        raise ConfigError(f"override {override!r}: expected dotted.key=value")
    key, raw = override.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {override!r}: empty key part")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as error:
        raise ConfigError(f"override {override!r}: value is not valid YAML ({error})") from error
    return key.split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Set each ``dotted.key=value``; list elements are addressed by index (``datasets.0.name``)."""
    for override in overrides:
        parts, value = parse_override(override)
        node: Any = data
        for depth, part in enumerate(parts[:-1]):
            where = ".".join(parts[: depth + 1])
            if isinstance(node, list):
                if not part.isdigit() or int(part) >= len(node):
                    raise ConfigError(f"override {override!r}: {where} is not an index of the list")
                node = node[int(part)]
            else:
                if node.get(part) is None:
                    node[part] = {}
                node = node[part]
            if not isinstance(node, dict | list):
                raise ConfigError(f"override {override!r}: {where} is a value, not a section")
        last = parts[-1]
        if isinstance(node, list):
            if not last.isdigit() or int(last) >= len(node):
                raise ConfigError(f"override {override!r}: {last} is not an index of the list")
            node[int(last)] = value
        else:
            node[last] = value
    return data


def config_from_dict(data: dict, overrides: list[str] | None = None) -> Config:
    """Validate a plain mapping (as read from YAML) into a :class:`Config`."""
    data = _objective_as_mapping(copy.deepcopy(data))
    for override in overrides or []:
        data = _objective_as_mapping(apply_overrides(data, [override]))
    return validate(_build_dataclass(Config, data, ""))


def _objective_as_mapping(data: dict) -> dict:
    """``training.objective: jsd`` as ``{name: jsd}``, so that ``training.objective.beta=...`` applies."""
    training = data.get("training")
    for key in ("objective", "off_policy_objective"):
        if isinstance(training, dict) and isinstance(training.get(key), str):
            training[key] = {"name": training[key]}
    return data


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Read a YAML config file, apply dotted overrides, validate."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte {error.object[error.start]:#04x} at offset {error.start}); "
            "save the config as UTF-8"
        ) from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as error:
        raise ConfigError(_yaml_problem(path, error)) from None
    except RecursionError:
        raise ConfigError(f"{path}: not a config: nested too deeply for YAML to read") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys")
    try:
        return config_from_dict(data, overrides)
    except ConfigError as error:
        raise ConfigError(f"{path}: {error}") from error


def _yaml_problem(path: Path, error: yaml.YAMLError) -> str:
    """``file:line:column: not valid YAML: what the parser expected``, as compilers put it."""
    mark = getattr(error, "problem_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    problem = getattr(error, "problem", None) or str(error)
    context, opened = getattr(error, "context", None), getattr(error, "context_mark", None)
    if context and opened is not None:
        context += f" opened at line {opened.line + 1}, column {opened.column + 1}"
    return f"{where}: not valid YAML: {problem}" + (f" ({context})" if context else "")


def recorded_config(config: Config) -> dict:
    """The config as a run records it (``config.yaml``, W&B, MLflow): credentials in URLs masked."""
    return redact_values(config_to_dict(config))


def objective_mapping(objective: Objective) -> dict:
    """An objective as a config writes it: ``{name: ..., option: value, ...}``."""
    return {"name": objective.name, **dataclasses.asdict(objective)}


def config_to_dict(config: Config) -> dict:
    """A plain mapping that :func:`config_from_dict` turns back into an equal config."""
    data = dataclasses.asdict(config)
    data["training"]["objective"] = objective_mapping(config.training.objective)
    if config.training.off_policy_objective is not None:
        data["training"]["off_policy_objective"] = objective_mapping(config.training.off_policy_objective)
    for dataset, written in zip(config.datasets, data["datasets"], strict=True):
        if dataset.env is not None:
            written["env"] = dataset.env.mapping()
    return data
