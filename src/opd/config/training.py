"""The ``training`` section: one flat mapping in YAML, declared here as the sections a reader can
hold (what is learnt from, optimisation, policy gradient, the task's reward, micro-batching,
collection, parallel, monitoring), each checking its own fields. :class:`TrainingConfig` is all of
them together.

The YAML stays flat (``training.learning_rate``, not ``training.optimization.learning_rate``): every
config, recipe and recorded ``config.yaml`` written so far reads as before, and a resumed run finds
its recorded keys where it wrote them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

from opd.checks import range_problems
from opd.config.execution import (
    CollectionSettings,
    MicroBatchSettings,
    MonitoringSettings,
    ParallelSettings,
)
from opd.objectives.base import Objective
from opd.objectives.policy_losses import LOSS_FN_CONFIG_KEYS
from opd.objectives.rollout_correction import RolloutCorrection


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

    def problems(self) -> Iterator[tuple[str, str]]:
        """``(field, problem)`` for the schedule's own fields."""
        for key in ("start", "end"):
            share = getattr(self, key)
            if not 0.0 <= share <= 1.0:
                yield key, f"must be in [0, 1], got {share}"
        yield from range_problems(self, positive=("steps",))


@dataclass
class DataSourceSettings:
    """What the student learns from: who writes each batch's completions, how they are sampled,
    and the objective on them."""

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
    max_tokens: int = 64
    """Most tokens sampled per completion."""
    temperature: float = 1.0
    """Sampling temperature; the student's log-probs in the loss use the same temperature."""

    def problems(self) -> Iterator[tuple[str, str]]:
        """``(field, problem)`` for this section's own fields."""
        yield from range_problems(self, positive=("max_tokens", "temperature"))
        if not isinstance(self.lmbda, LambdaSchedule) and not 0.0 <= self.lmbda <= 1.0:
            yield "lmbda", f"must be in [0, 1], got {self.lmbda}"
        if self.off_policy_objective is not None and self.data_source != "mixed":
            yield (
                "off_policy_objective",
                (
                    "applies to the teacher's steps of data_source: mixed; with "
                    f"'{self.data_source}' training.objective applies to every batch: remove it, "
                    "or set the objective there"
                ),
            )

    def objective_for(self, source: str) -> Objective:
        """The objective of a batch written by ``source`` (``student``, ``teacher`` or
        ``dataset``)."""
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


@dataclass
class OptimizationSettings:
    """The optimizer, its schedule and the run's length."""

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
    loss_aggregation: Literal["token_mean", "sequence_mean", "sum"] = "token_mean"
    """``sum`` over tokens as the reference does, or a mean that transfers across batch sizes."""
    num_substeps: int = 1
    """Optimizer steps per batch, each on a contiguous slice of the sequences."""
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

    def problems(self) -> Iterator[tuple[str, str]]:
        """``(field, problem)`` for this section's own fields."""
        yield from range_problems(
            self,
            positive=("learning_rate", "num_substeps", "max_steps", "max_grad_norm", "adam_eps"),
            non_negative=("warmup_steps", "weight_decay"),
        )
        for name in ("adam_beta1", "adam_beta2"):  # a moving average's factor: 1 would never move
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                yield name, f"must be in [0, 1), got {value}"


@dataclass
class PolicyGradientSettings:
    """How objectives with advantages (``sampled_reverse_kl``) turn the teacher's judgement into
    per-token advantages, and the policy loss they take."""

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
    distillation, AsyncOPD: arXiv 2606.24143). The importance ratio of the policy loss stays against
    the behaviour log-probs either way. Unset: ``current`` where ``max_staleness`` > 0 (samples four
    updates stale otherwise undo the run: docs/distributed.md), else ``behaviour``."""
    loss_fn: Literal["importance_sampling", "ppo", "cispo", "dro"] = "importance_sampling"
    """Objectives with advantages: the policy loss on the sampled tokens (formulas in
    ``opd.objectives.policy_losses``)."""
    loss_fn_config: dict[str, float] = field(default_factory=dict)
    """Knobs of ``loss_fn``: ``clip_low_threshold`` / ``clip_high_threshold`` (ppo, cispo), ``beta``
    (dro)."""
    rollout_correction: RolloutCorrection | Literal["off", False] | None = None
    """The policy loss's weight of tokens the sampler and the trainer disagree on (objectives with
    advantages, and the reward term): ``{mode: truncate | mask, level: token | sequence, cap: 2.0}``
    bounds it (``opd.objectives.rollout_correction``; metrics ``rollout_correction/*``); ``off``
    (or false, as YAML reads a bare off) takes the ratio as it is. Unset: ``{mode: truncate}`` where
    the sampler is not the trainer's own forward (``student.sampler`` vllm or vllm_server, or a
    ``student.sampling_dtype``), else ``off`` (docs/objectives.md has the measurement)."""

    def problems(self) -> Iterator[tuple[str, str]]:
        """``(field, problem)`` for this section's own fields."""
        yield from range_problems(
            self, positive=("advantage_clip",), non_negative=("kl_penalty_coef",)
        )
        if not 0.0 <= self.kl_discount_factor < 1.0:
            yield "kl_discount_factor", f"must be in [0, 1), got {self.kl_discount_factor}"
        allowed = LOSS_FN_CONFIG_KEYS[self.loss_fn]
        for key in self.loss_fn_config:
            if key not in allowed:
                yield (
                    f"loss_fn_config.{key}",
                    (
                        f"not a knob of loss_fn '{self.loss_fn}' (it takes: "
                        f"{sorted(allowed) or 'none'})"
                    ),
                )

    def policy_gradient_keys_set(self) -> list[str]:
        """The settings of this section given values other than their defaults (an objective
        without advantages would ignore them)."""
        defaults = PolicyGradientSettings()
        return [
            f.name
            for f in dataclasses.fields(PolicyGradientSettings)
            if getattr(self, f.name) != getattr(defaults, f.name)
            and f.name
            != "rollout_correction"  # filled in by sampler, and read by the reward term too
        ]

    @property
    def correction(self) -> RolloutCorrection | None:
        """``rollout_correction`` as the loss reads it (None: off)."""
        return (
            self.rollout_correction
            if isinstance(self.rollout_correction, RolloutCorrection)
            else None
        )


@dataclass
class RewardSettings:
    """The task's reward beside the teacher's signal: each of the student's own samples graded (its
    dataset's grader, or its episode's reward, the sum of its steps') and centred within its
    group."""

    reward_coef: float = 0.0
    """Weight of the task's reward in each completion token's advantage: ``reward_coef * (R - mean
    of R over the sample's group)`` (a group: the ``group_size`` samples of one prompt), added to
    the teacher's per-token term, as the reference loop does. ``R`` is the grade of a single-turn
    completion by its dataset's ``grader``, or an episode's reward (the sum of its steps').
    Objectives with advantages (``sampled_reverse_kl``) add it to theirs; the others add a policy
    gradient on the sampled tokens with it (``loss_fn`` on the reward term) to their loss. Only the
    student's own samples get it (not the teacher's or a dataset's). 0: pure distillation, as
    before; rewards are logged (``reward/*``) whenever a grader or environment gives them."""
    remove_constant_reward_groups: bool = False
    """Leave out of the step's update the groups whose samples all got the same reward (the
    reference's flag; logged as ``reward/constant_groups``): they carry no reward signal, and
    their teacher term goes with them. A step whose groups are all constant is skipped."""
    reward_std_normalization: bool = False
    """Divide each group's centred rewards by the group's standard deviation (GRPO's), so a group
    whose samples differ a little weighs as much as one whose samples differ a lot."""

    def problems(self) -> Iterator[tuple[str, str]]:
        """``(field, problem)`` for this section's own fields."""
        yield from range_problems(self, non_negative=("reward_coef",))
        if self.reward_coef == 0:
            for key in ("remove_constant_reward_groups", "reward_std_normalization"):
                if getattr(self, key):
                    yield (
                        key,
                        "shapes the reward term, and reward_coef is 0: set reward_coef > 0, or "
                        "remove it",
                    )


@dataclass
class TrainingConfig(
    MonitoringSettings,
    ParallelSettings,
    CollectionSettings,
    MicroBatchSettings,
    RewardSettings,
    PolicyGradientSettings,
    OptimizationSettings,
    DataSourceSettings,
):
    """The optimisation loop: every section above, as one flat ``training`` mapping."""

    def problems(self) -> Iterator[tuple[str, str]]:
        """``(field, problem)`` for every section's own fields."""
        for section in reversed(TrainingConfig.__bases__):
            if hasattr(section, "problems"):
                yield from section.problems(self)

    @property
    def advantage_source(self) -> Literal["behaviour", "current"]:
        """``advantage_logprobs``, or what its unset value means for this run."""
        if self.advantage_logprobs is not None:
            return self.advantage_logprobs
        return "current" if self.max_staleness > 0 else "behaviour"
