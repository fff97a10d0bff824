"""The run configuration: typed, documented where declared, validated on load.

A YAML file maps onto :class:`Config`; ``dotted.key=value`` overrides from the command line
are applied before validation. Unknown keys, wrong types and out-of-range values raise
:class:`ConfigError` naming the field (and a close spelling when there is one).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from opd.objectives.policy_losses import LOSS_FN_CONFIG_KEYS


class ConfigError(ValueError):
    """A configuration problem, with the dotted path of the offending field in the message."""


@dataclass
class StudentConfig:
    """The model being trained."""

    model: str
    """Hugging Face model id or local directory."""
    lora_rank: int = 32
    """LoRA rank; 0 trains every weight (full fine-tuning)."""
    lora_alpha: float | None = None
    """LoRA scaling numerator; defaults to ``lora_rank`` (scale 1)."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA branch."""
    lora_target_modules: list[str] | str = "all-linear"
    """Modules that get adapters: PEFT's ``all-linear`` (every linear layer but the lm head) or names."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights dtype; ``auto`` is bfloat16 on a GPU that supports it, float32 otherwise."""
    device: str = "auto"
    """``auto`` (CUDA if available, else CPU), or a torch device string such as ``cuda:1``."""
    chat_template: str | None = None
    """A Jinja chat template replacing the tokenizer's own (required for base models without one)."""
    tokenizer: str | None = None
    """Tokenizer id or path when it is not stored with the model."""
    trust_remote_code: bool = False
    """Run model code shipped in the checkpoint; off unless you trust its source."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward: less memory, about a third more compute."""
    sampling_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """Sample rollouts from a copy of the student in this dtype (None: from the student itself).
    The copy's weights are cast in before every rollout and freed after it; ``bfloat16``
    under a float32 student halves the bytes each decode step reads (1.5-1.9x faster on a CPU
    with AVX-512; without it bfloat16 matmuls take a fallback ~100x slower, and opd warns).
    A LoRA student's adapters are merged into the copy (one matmul per layer instead of
    three), so with LoRA a copy in the student's own dtype is made too and samples faster.
    Its log-probs are the copy's, so the policy loss's importance ratio covers the gap, as it
    does for a vLLM sampler. Evaluation always decodes with the student itself."""


@dataclass
class TeacherConfig:
    """The model whose per-token judgement trains the student. Scored in one no-grad forward."""

    model: str
    """Hugging Face model id or local directory (``local``), or the served model name (remote)."""
    backend: Literal["local", "openai", "sglang"] = "local"
    """``local``: in the trainer's process; ``openai``: a vLLM (OpenAI-compatible) server;
    ``sglang``: an SGLang server. Remote teachers must share the student's token ids."""
    base_url: str | None = None
    """Remote server, as OpenAI clients take it: ``http://127.0.0.1:8000/v1`` (vLLM),
    ``http://127.0.0.1:30000`` (SGLang)."""
    api_key_env: str | None = None
    """Name of the environment variable holding the server's API key (the key is never logged or saved)."""
    tokenizer: str | None = None
    """The teacher's tokenizer (id or path), checked against the student's; default: ``model`` when local."""
    chat_template: str | None = None
    """Render prompts for the teacher in its own format: a Jinja template, or ``tokenizer`` for
    the teacher tokenizer's template. Unset: the teacher sees the student's rendering."""
    cross_tokenizer: bool = False
    """The teacher's tokenizer differs from the student's: completions are re-tokenized for it
    and aligned on character offsets (``sampled_reverse_kl`` and ``k3`` on student samples only)."""
    timeout_s: float = 60.0
    """Remote: seconds to wait for one answer before retrying."""
    max_retries: int = 4
    """Remote: retries after a connection error, timeout or 5xx (exponential backoff with jitter)."""
    max_concurrency: int = 4
    """Remote: requests in flight at once."""
    request_batch_size: int = 8
    """Remote (openai): sequences per request."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Local: weights dtype, as for the student."""
    device: str = "auto"
    """Local: device, as for the student."""
    trust_remote_code: bool = False
    """Local: run model code shipped in the checkpoint."""


@dataclass
class DatasetConfig:
    """One prompt source. Every step takes ``groups_per_batch`` prompts from each dataset."""

    name: str
    """Used in metric names (``teacher_kl/<name>``) and example printouts."""
    source: str
    """A JSONL file: one ``{"prompt": ...}`` or ``{"messages": [...]}`` object per line,
    optionally with an ``answer``; or ``demo:<task>`` for a built-in generated task."""
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
    """Held-out prompts; defaults to the ``@test`` split of a generated source, none for files."""
    eval_num_prompts: int = 64
    """Held-out prompts used per evaluation."""
    grader: Literal["auto", "exact_match", "last_number", "reasoning_gym", "none"] = "auto"
    """How answers are scored: ``auto`` is the task's scorer for reasoning-gym, exact match otherwise."""


@dataclass
class TrainingConfig:
    """The optimisation loop."""

    objective: Literal["sampled_reverse_kl", "k3", "jsd", "topk_forward_kl", "nll"] = "sampled_reverse_kl"
    """What the student minimises on each batch:
    ``sampled_reverse_kl``: negative per-token reverse KL as the advantage of a policy-gradient ``loss_fn``;
    ``k3``: the differentiable k3 estimate on the sampled tokens (``kl_direction``);
    ``jsd``: full-distribution generalized JSD (``beta``), teacher in process only;
    ``topk_forward_kl``: forward KL over the teacher's ``topk`` tokens plus a tail bucket;
    ``nll``: negative log-likelihood of the tokens (SFT on teacher or dataset completions)."""
    kl_direction: Literal["reverse", "forward"] = "reverse"
    """``k3`` only: ``reverse`` is k3(teacher, student), an estimate of KL(student || teacher) on
    student samples; ``forward`` is k3(student, teacher), KL(teacher || student) on teacher samples."""
    beta: float = 0.5
    """``jsd`` only: 0 is forward KL(teacher || student), 1 is reverse KL(student || teacher)."""
    topk: int = 32
    """``topk_forward_kl`` only: teacher tokens kept per position (the rest is one bucket)."""
    data_source: Literal["student", "teacher", "mixed", "dataset"] = "student"
    """Where completions come from: ``student`` samples (on-policy), ``teacher`` samples
    (sequence-level KD), ``mixed`` (on-policy with probability ``lmbda`` per step, else
    teacher), or ``dataset`` (each prompt's ``completion``, else ``answer``; one per prompt)."""
    lmbda: float = 0.5
    """``mixed`` only: fraction of steps whose batch the student samples (GKD's lambda)."""
    learning_rate: float = 1e-4
    """Peak learning rate, reached after ``warmup_steps``."""
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
    """Weight of the negative reverse KL in the per-token advantage."""
    kl_discount_factor: float = 0.0
    """When > 0, each token's advantage becomes the discounted sum of the advantages after it."""
    loss_fn: Literal["importance_sampling", "ppo", "cispo", "dro"] = "importance_sampling"
    """Policy loss on the sampled tokens (formulas in ``opd.objectives.policy_losses``)."""
    loss_fn_config: dict[str, float] = field(default_factory=dict)
    """Knobs of ``loss_fn``: ``clip_low_threshold`` / ``clip_high_threshold`` (ppo, cispo), ``beta`` (dro)."""
    loss_aggregation: Literal["token_mean", "sequence_mean", "sum"] = "token_mean"
    """``sum`` over tokens as the reference does, or a mean that transfers across batch sizes."""
    num_substeps: int = 1
    """Optimizer steps per batch, each on a contiguous slice of the sequences."""
    micro_batch_size: int | None = None
    """Sequences per forward/backward inside a substep (gradient accumulation); None = all."""
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
    head and the log-probs stay in the weights' dtype (float32 on a CPU). About a third off the
    update where bfloat16 matmuls are fast (GPUs; CPUs with avx512_bf16 or AMX), slower on
    CPUs without them, and ~100x slower on a CPU without AVX-512 (opd warns). Rollouts, teacher
    and evaluation are untouched (see ``student.sampling_dtype``, ``teacher.dtype``). float16
    is not offered: it needs loss scaling."""
    logprob_chunk_size: int = 1024
    """Positions whose logits exist at once when computing log-probs (memory vs speed)."""
    teacher_batch_size: int = 32
    """Sequences per teacher forward."""
    show_examples: bool = False
    """Print one coloured sample per dataset per step (prompt, trained tokens, per-token KL)."""


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
    if dataclasses.is_dataclass(tp):
        return _build_dataclass(tp, value, path)
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        try:
            return float(value)  # YAML 1.1 reads 3e-5 (no dot) as a string
        except ValueError:
            raise ConfigError(f"{path}: expected float, got str {value!r}") from None
    if tp is bool and not isinstance(value, bool):
        raise ConfigError(f"{path}: expected true or false, got {value!r}")
    if tp is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{path}: expected an integer, got {value!r}")
    if not isinstance(value, tp):
        raise ConfigError(f"{path}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
    return value


def _build_dataclass(cls: type, data: Any, path: str) -> Any:
    prefix = f"{path}." if path else ""
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping, got {type(data).__name__} {data!r}")
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = [key for key in data if key not in known]
    if unknown:
        key = unknown[0]
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
    _positive(config.student.lora_rank, "student.lora_rank", allow_zero=True)
    _positive(config.save_every, "save_every", allow_zero=True)
    _positive(config.eval_every, "eval_every", allow_zero=True)
    training = config.training
    _positive(training.learning_rate, "training.learning_rate")
    _positive(training.temperature, "training.temperature")
    _positive(training.max_tokens, "training.max_tokens")
    _positive(training.num_substeps, "training.num_substeps")
    _positive(training.micro_batch_size, "training.micro_batch_size")
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
    for key in ("beta", "lmbda"):
        value = getattr(training, key)
        if not 0.0 <= value <= 1.0:
            raise ConfigError(f"training.{key}: must be in [0, 1], got {value}")
    _positive(training.topk, "training.topk")
    if training.objective == "sampled_reverse_kl" and training.data_source != "student":
        raise ConfigError(
            f"training.data_source: '{training.data_source}' gives batches the student did not sample, but "
            "objective 'sampled_reverse_kl' is a policy gradient on the student's own samples; use "
            "data_source: student, or an objective that works off-policy (k3, jsd, topk_forward_kl, nll)"
        )
    if training.objective == "nll" and training.data_source in ("student", "mixed"):
        raise ConfigError(
            f"training.data_source: '{training.data_source}' includes student samples, and objective "
            "'nll' on them would fit the student to itself without the teacher; use data_source: teacher "
            "or dataset"
        )
    teachers = [("teacher", config.teacher)] + [
        (f"datasets[{i}].teacher", d.teacher) for i, d in enumerate(config.datasets) if d.teacher
    ]
    for where, teacher in teachers:
        if teacher.cross_tokenizer:
            if training.objective not in ("sampled_reverse_kl", "k3") or training.data_source != "student":
                raise ConfigError(
                    f"{where}.cross_tokenizer: supported with objective sampled_reverse_kl or k3 on student "
                    f"samples; '{training.objective}' on '{training.data_source}' data needs the student's "
                    "token ids (full distributions and top-k are over the student's vocabulary)"
                )
            if teacher.backend != "local" and not teacher.tokenizer:
                raise ConfigError(f"{where}.tokenizer: required for cross_tokenizer with a remote teacher")
        if teacher.chat_template == "tokenizer" and teacher.backend != "local" and not teacher.tokenizer:
            raise ConfigError(
                f"{where}.tokenizer: required to use the tokenizer's chat template of a remote teacher"
            )
        if teacher.backend == "local":
            continue
        if not teacher.base_url:
            raise ConfigError(f"{where}.base_url: required for backend '{teacher.backend}'")
        if training.objective == "jsd":
            raise ConfigError(
                f"training.objective: 'jsd' needs the teacher's full distribution, which {where} "
                f"(backend '{teacher.backend}') does not send; use topk_forward_kl, or a local teacher"
            )
        if training.data_source in ("teacher", "mixed"):
            raise ConfigError(
                f"training.data_source: '{training.data_source}' samples from the teacher model in process; "
                f"{where} is remote (backend '{teacher.backend}')"
            )
        if training.objective == "topk_forward_kl" and training.temperature != 1.0:
            raise ConfigError(
                "training.temperature: remote servers send top-k log-probs at temperature 1; "
                "topk_forward_kl with a remote teacher needs temperature: 1.0"
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
    data = apply_overrides(copy.deepcopy(data), overrides or [])
    return validate(_build_dataclass(Config, data, ""))


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Read a YAML config file, apply dotted overrides, validate."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {error}") from error
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys")
    try:
        return config_from_dict(data, overrides)
    except ConfigError as error:
        raise ConfigError(f"{path}: {error}") from error


def config_to_dict(config: Config) -> dict:
    """A plain mapping that :func:`config_from_dict` turns back into an equal config."""
    return dataclasses.asdict(config)
