"""Learning, the second room of a step: from a finished :class:`Batch`, the step's metrics, the
advantages (for objectives that use them, from the behaviour or the current log-probs) and
``num_substeps`` optimizer steps; with the current policy's log-probs and the post-update KL it
needs on the way."""

from __future__ import annotations

import math
import time
import warnings

import torch

from opd.data.batching import contiguous_slices
from opd.data.sequences import RolloutBatch
from opd.distributed import all_reduce
from opd.objectives.advantages import standardized
from opd.runs.timing import SpanRecorder
from opd.trainer.batch import Batch
from opd.trainer.components import RunComponents
from opd.trainer.episode_metrics import episode_metrics
from opd.trainer.update import policy_gradient, policy_update


def advantage_metrics(advantages_BT: torch.Tensor, mask_BT: torch.Tensor) -> dict[str, float]:
    """Mean, spread and extremes of the per-token advantages over every process's completion
    tokens: advantages of tens of nats mean the student writes what the teacher would not."""
    selected = advantages_BT[mask_BT.bool()].double()
    sums = [float(selected.sum()), float(selected.square().sum()), float(selected.numel())]
    total, squares, count = all_reduce(sums)
    if count == 0:
        return {}
    extremes = [float(-selected.min()), float(selected.max())] if selected.numel() else [-math.inf] * 2
    negated_min, most = all_reduce(extremes, op="max")
    mean = total / count
    return {
        "advantage/mean": mean,
        "advantage/std": math.sqrt(max(squares / count - mean * mean, 0.0)),
        "advantage/min": -negated_min,
        "advantage/max": most,
    }


class Learning(RunComponents):
    """The update from a finished batch, on the run's components."""

    spans: SpanRecorder
    """Where each phase's time is recorded (set by the run loop)."""

    def kl_metrics(self, batch: Batch) -> dict[str, float]:
        """``teacher_kl`` = sum(reverse KL) / completion tokens, overall and per dataset (over
        every process's share)."""
        rollouts, reverse_kl = batch.rollouts, batch.reverse_kl_BT
        sums = [float(reverse_kl.sum()), float(rollouts.mask_BT.sum())]
        for index in range(len(self.config.datasets)):
            rows = rollouts.dataset_index_B == index
            sums += [float(reverse_kl[rows].sum()), float(rollouts.mask_BT[rows].sum())]
        sums = all_reduce(sums)
        metrics = {"teacher_kl": sums[0] / max(sums[1], 1.0)}
        for index, dataset in enumerate(self.config.datasets):
            kl, tokens = sums[2 + 2 * index : 4 + 2 * index]
            if tokens > 0:
                metrics[f"teacher_kl/{dataset.name}"] = kl / tokens
        return metrics

    def learn(self, batch: Batch) -> dict[str, float]:
        """Advantages and the update from a finished batch; returns the step's metrics (the whole
        batch's, reduced over processes, but for times, which are this process's)."""
        training, rollouts, teacher = self.config.training, batch.rollouts, batch.teacher
        objective = training.objective_for(batch.source)
        mask = rollouts.mask_BT
        lengths = mask.sum(-1)
        metrics: dict[str, float] = {"step": batch.step, "on_policy": int(batch.on_policy)}
        if self.config.training.data_source == "mixed":
            metrics["lmbda"] = self.config.training.lmbda_at(batch.step)
        if batch.on_policy and teacher is not None:
            metrics |= self.kl_metrics(batch)
        if any(self.environments):
            metrics |= episode_metrics(rollouts, batch.reverse_kl_BT if batch.on_policy else None)
        scored = mask.bool()
        finite = (teacher is None or bool(torch.isfinite(teacher.logprobs_BT[scored]).all())) and bool(
            torch.isfinite(rollouts.sampled_logprobs_BT[scored]).all()
        )
        tokens, sequences, truncated, not_finite = all_reduce(
            [
                float(lengths.sum()),
                float(mask.shape[0]),
                float((~rollouts.finished_B).sum()),
                float(not finite),
            ]
        )
        metrics |= {
            "num_tokens": int(tokens),
            "num_sequences": int(sequences),
            "completion_len_mean": tokens / sequences,
            "frac_truncated": truncated / sequences,
            "lr": self.scheduler.get_last_lr()[0],
        }
        if batch.staleness is not None:
            metrics["staleness_mean"] = batch.staleness
        if not_finite:
            warnings.warn(
                f"step {batch.step}: non-finite log-probs from the sampler or teacher; step skipped",
                stacklevel=2,
            )
            return metrics | {"skipped": 1} | batch.seconds
        advantages = torch.zeros_like(mask)
        if teacher is not None:
            student_logprobs = rollouts.sampled_logprobs_BT
            if training.advantage_source == "current" and batch.on_policy:
                student_logprobs = self.policy_logprobs(rollouts).to(student_logprobs.device)
            shaped = objective.advantages(student_logprobs, teacher, mask, policy_gradient(training))
            if shaped is not None:
                spread = advantage_metrics(shaped, mask)
                metrics |= spread
                advantages = (
                    standardized(shaped, mask, spread["advantage/mean"], spread["advantage/std"])
                    if training.normalize_advantages and spread
                    else shaped
                )
        started = time.perf_counter()
        with self.spans.span(batch.step, "train"):
            stats = policy_update(
                self.policy,
                objective,
                self.optimizer,
                self.scheduler,
                rollouts,
                teacher,
                advantages,
                training,
                self.batching,
            )
        train_seconds = time.perf_counter() - started
        metrics |= {
            "loss": stats.loss,
            f"objective/{objective.name}": stats.objective_value,
            "entropy": stats.entropy,
            "grad_norm": stats.grad_norm,
            "skipped": int(stats.applied_substeps == 0),
            **batch.seconds,
            "time/train": train_seconds,
            "time/total": batch.seconds["time/sample"] + batch.seconds["time/teacher"] + train_seconds,
        }
        if batch.on_policy:
            metrics["kl_sample_train"] = stats.kl_sample_train
            if self.config.compute_post_kl:
                metrics["post_kl"] = self.post_update_kl(rollouts)
        return metrics

    def train_step(self, step: int) -> dict[str, float]:
        """Collect step ``step``'s batch and learn from it; returns the step's metrics."""
        return self.learn(self.collect(step))

    @torch.no_grad()
    def policy_logprobs(self, rollouts: RolloutBatch) -> torch.Tensor:
        """The student's current log-prob of every completion token of ``rollouts`` (B, T), at the
        run's temperature, detached; forwarded in the update's own micro-batches (the same rows
        per forward on any number of processes, and no more memory than the update takes). A
        forward every process makes together when the student is sharded; with gradients on,
        FSDP would wait for a backward that never comes."""
        training = self.config.training
        logprobs_BT = torch.zeros_like(rollouts.sampled_logprobs_BT)
        for substep in contiguous_slices(len(rollouts.prompt_lengths), training.num_substeps):
            part = rollouts.select(substep)
            for rows in self.batching.split(part):
                piece = part.select(rows)
                logprobs, _ = self.policy.sequence_logprobs(
                    piece.input_ids_BT,
                    piece.attention_mask_BT,
                    piece.mask_BT,
                    temperature=training.temperature,
                    chunk_size=training.logprob_chunk_size,
                )
                logprobs_BT[[substep.start + row for row in rows]] = logprobs.to(logprobs_BT.device)
        self.policy.reshard()
        return logprobs_BT

    @torch.no_grad()
    def post_update_kl(self, rollouts: RolloutBatch) -> float:
        """KL(policy before || after) the update, per token, on the batch the student sampled."""
        logprobs = self.policy_logprobs(rollouts)
        mask = rollouts.mask_BT.to(logprobs.device)
        sampled = rollouts.sampled_logprobs_BT.to(logprobs.device)
        kl, tokens = all_reduce([float(((sampled - logprobs) * mask).sum()), float(mask.sum())])
        return kl / max(tokens, 1.0)
