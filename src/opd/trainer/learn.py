"""Learning, the second room of a step: from a finished :class:`Batch`, the step's metrics, the
advantages (for objectives that use them, from the behaviour or the current log-probs) and
``num_substeps`` optimizer steps; with the current policy's log-probs and the post-update KL it
needs on the way."""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import replace

import torch

from opd.assemble.run import RunComponents
from opd.data.batching import contiguous_slices
from opd.data.sequences import RolloutBatch
from opd.distributed import all_reduce
from opd.objectives.advantages import group_centred_rewards, standardized
from opd.runs.timing import SpanRecorder
from opd.sampling.vllm_server import VLLMServerEngine
from opd.trainer.batch import Batch
from opd.trainer.diagnostics import diagnostic_metrics
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
    extremes = (
        [float(-selected.min()), float(selected.max())] if selected.numel() else [-math.inf] * 2
    )
    negated_min, most = all_reduce(extremes, op="max")
    mean = total / count
    return {
        "advantage/mean": mean,
        "advantage/std": math.sqrt(max(squares / count - mean * mean, 0.0)),
        "advantage/min": -negated_min,
        "advantage/max": most,
    }


def magnitudes(terms: dict[str, torch.Tensor], mask_BT: torch.Tensor) -> dict[str, float]:
    """Each advantage term's mean absolute value over every process's completion tokens."""
    selected = mask_BT.bool()
    sums = all_reduce(
        [float(term[selected].abs().sum()) for term in terms.values()] + [float(selected.sum())]
    )
    return {name: value / max(sums[-1], 1.0) for name, value in zip(terms, sums, strict=False)}


class Learner:
    """The update from a finished batch, on the run's parts (the student, its optimizer and
    schedule, the micro-batching), read as they are when a batch is learnt."""

    def __init__(self, parts: RunComponents):
        self.parts = parts
        self.spans = SpanRecorder(None)
        """Where each phase's time is recorded (the run loop gives its own)."""

    def kl_metrics(self, batch: Batch) -> dict[str, float]:
        """``teacher_kl`` = sum(reverse KL) / completion tokens, overall and per dataset (over
        every process's share); with a mixture, ``teacher_kl/mixture_<i>`` to its i-th teacher alone
        (on the rows of the datasets a mixture scores)."""
        rollouts, reverse_kl = batch.rollouts, batch.reverse_kl_BT
        sums = [float(reverse_kl.sum()), float(rollouts.mask_BT.sum())]
        for index in range(len(self.parts.config.datasets)):
            rows = rollouts.dataset_index_B == index
            sums += [float(reverse_kl[rows].sum()), float(rollouts.mask_BT[rows].sum())]
        members = max(
            len(self.parts.config.teacher_for(d).members) for d in self.parts.config.datasets
        )
        kept = batch.teacher.member_logprobs_MBT
        for number in range(members if members > 1 else 0):
            if kept is None or number >= kept.shape[0]:
                sums += [0.0, 0.0]
                continue
            scored = rollouts.mask_BT.bool() & kept[number].isfinite()
            gap = rollouts.sampled_logprobs_BT[scored] - kept[number][scored]
            sums += [float(gap.sum()), float(scored.sum())]
        sums = all_reduce(sums)
        metrics = {"teacher_kl": sums[0] / max(sums[1], 1.0)}
        for index, dataset in enumerate(self.parts.config.datasets):
            kl, tokens = sums[2 + 2 * index : 4 + 2 * index]
            if tokens > 0:
                metrics[f"teacher_kl/{dataset.name}"] = kl / tokens
        first = 2 + 2 * len(self.parts.config.datasets)
        for number in range(members if members > 1 else 0):
            kl, tokens = sums[first + 2 * number : first + 2 + 2 * number]
            if tokens > 0:
                metrics[f"teacher_kl/mixture_{number}"] = kl / tokens
        return metrics

    def reward_terms(
        self, batch: Batch
    ) -> tuple[dict[str, float], torch.Tensor | None, torch.Tensor | None]:
        """The task's rewards of the student's samples: their metrics (over every process's rows;
        logged whatever ``reward_coef``), each completion token's reward advantage
        ``reward_coef * (R - group mean)`` (None with ``reward_coef: 0``), and which rows the update
        keeps (None: all; ``remove_constant_reward_groups`` drops groups whose rewards are all
        equal). A group's rows all lie on one process, so its mean is the whole group's."""
        training, rollouts, rewards = self.parts.config.training, batch.rollouts, batch.rewards_B
        centred, group_std, constant = group_centred_rewards(
            rewards, batch.groups_B, std_normalization=training.reward_std_normalization
        )
        graded = ~torch.isnan(rewards)
        firsts = torch.zeros_like(graded)  # one row per graded group, for per-group figures
        shared = torch.zeros_like(graded)  # ... of a group of two or more graded rows
        for group in torch.unique(batch.groups_B[graded]):
            rows = torch.nonzero(graded & (batch.groups_B == group))
            firsts[int(rows[0])] = True
            shared[int(rows[0])] = len(rows) > 1
        sums = [
            float(rewards[graded].sum()),
            float(graded.sum()),
            float(group_std[firsts].sum()),
            float(constant[shared].sum()),
            float(firsts.sum()),
            float(shared.sum()),
        ]
        names = [d.name for d in self.parts.config.datasets]
        for index in range(len(names)):
            rows = graded & (rollouts.dataset_index_B == index)
            sums += [float(rewards[rows].sum()), float(rows.sum())]
        sums = all_reduce(sums)
        total, count, spread, constant_groups, groups, shared_groups = sums[:6]
        if count == 0:  # this step's rows all come from datasets without a reward
            return {}, None, None
        metrics = {
            "reward/mean": total / max(count, 1.0),
            "reward/group_std": spread / max(groups, 1.0),
        }
        if shared_groups:  # groups of one sample say nothing of a reward's spread
            metrics["reward/constant_groups"] = constant_groups / shared_groups
        for index, name in enumerate(names):
            value, rows = sums[6 + 2 * index : 8 + 2 * index]
            if rows > 0:
                metrics[f"reward/{name}"] = value / rows
        if not training.reward_coef:
            return metrics, None, None
        mask = rollouts.mask_BT
        reward_BT = (training.reward_coef * centred).to(mask.dtype)[:, None] * mask
        kept = ~constant if training.remove_constant_reward_groups else None
        return metrics, reward_BT, kept

    def learn(self, batch: Batch) -> dict[str, float]:
        """Advantages and the update from a finished batch; returns the step's metrics (the whole
        batch's, reduced over processes, but for times, which are this process's)."""
        training, rollouts, teacher = self.parts.config.training, batch.rollouts, batch.teacher
        objective = training.objective_for(batch.source)
        mask = rollouts.mask_BT
        lengths = mask.sum(-1)
        metrics: dict[str, float] = {"step": batch.step, "on_policy": int(batch.on_policy)}
        if self.parts.config.training.data_source == "mixed":
            metrics["lmbda"] = self.parts.config.training.lmbda_at(batch.step)
        metrics |= self.parts.teachers.replica_metrics()
        if isinstance(self.parts.engine, VLLMServerEngine):
            metrics |= self.parts.engine.pool_metrics()
        if batch.on_policy and teacher is not None:
            metrics |= self.kl_metrics(batch)
            metrics |= diagnostic_metrics(
                rollouts,
                batch.groups_B,
                batch.reverse_kl_BT,
                teacher,
                batch.rewards_B,
                self.parts.graders,
                self.parts.tokenizer,
            )
        if any(self.parts.environments):
            metrics |= episode_metrics(rollouts, batch.reverse_kl_BT if batch.on_policy else None)
        scored = mask.bool()
        finite = (
            teacher is None or bool(torch.isfinite(teacher.logprobs_BT[scored]).all())
        ) and bool(torch.isfinite(rollouts.sampled_logprobs_BT[scored]).all())
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
            "lr": self.parts.scheduler.get_last_lr()[0],
        }
        if batch.staleness is not None:
            metrics["staleness_mean"] = batch.staleness
        if not_finite:
            warnings.warn(
                f"step {batch.step}: non-finite log-probs from the sampler or teacher; step "
                "skipped",
                stacklevel=2,
            )
            return metrics | {"skipped": 1} | batch.seconds
        reward_BT, kept_B = None, None
        if batch.rewards_B is not None:
            rewards, reward_BT, kept_B = self.reward_terms(batch)
            metrics |= rewards
        if (
            kept_B is not None
        ):  # what the constant-group filter leaves the update, over every process
            rows, kept_tokens = all_reduce([float(kept_B.sum()), float(mask[kept_B].sum())])
            metrics |= {"reward/kept_rows": rows / sequences, "num_tokens_kept": int(kept_tokens)}
            if not rows:
                return (
                    metrics | {"skipped": 1} | batch.seconds
                )  # every group constant: nothing to learn
        shaped = None
        if teacher is not None:
            student_logprobs = rollouts.sampled_logprobs_BT
            if training.advantage_source == "current" and batch.on_policy:
                student_logprobs = self.policy_logprobs(rollouts).to(student_logprobs.device)
            shaped = objective.advantages(
                student_logprobs, teacher, mask, policy_gradient(training)
            )
        if shaped is not None and reward_BT is not None:
            metrics |= magnitudes(
                {"advantage/kl_abs_mean": shaped, "advantage/reward_abs_mean": reward_BT}, mask
            )
            shaped = shaped + reward_BT
        advantages, reward_in_loss = torch.zeros_like(mask), False
        if shaped is not None:
            spread = advantage_metrics(shaped, mask)
            metrics |= spread
            advantages = (
                standardized(shaped, mask, spread["advantage/mean"], spread["advantage/std"])
                if training.normalize_advantages and spread
                else shaped
            )
        elif (
            reward_BT is not None
        ):  # an objective without advantages: the reward as a policy gradient
            metrics |= magnitudes({"advantage/reward_abs_mean": reward_BT}, mask)
            advantages, reward_in_loss = reward_BT, True
        if kept_B is not None:
            rollouts = replace(
                rollouts, mask_BT=rollouts.mask_BT * kept_B[:, None].to(rollouts.mask_BT.dtype)
            )
        started = time.perf_counter()
        with self.spans.span(batch.step, "train"):
            stats = policy_update(
                self.parts.policy,
                objective,
                self.parts.optimizer,
                self.parts.scheduler,
                rollouts,
                teacher,
                advantages,
                training,
                self.parts.batching,
                reward_in_loss=reward_in_loss,
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
            "time/total": batch.seconds["time/sample"]
            + batch.seconds["time/teacher"]
            + train_seconds,
        }
        if batch.on_policy:
            metrics["kl_sample_train"] = stats.kl_sample_train
            metrics |= stats.correction
            if self.parts.config.compute_post_kl:
                metrics["post_kl"] = self.post_update_kl(rollouts)
        return metrics

    @torch.no_grad()
    def policy_logprobs(self, rollouts: RolloutBatch) -> torch.Tensor:
        """The student's current log-prob of every completion token of ``rollouts`` (B, T), at the
        run's temperature, detached; forwarded in the update's own micro-batches (the same rows
        per forward on any number of processes, and no more memory than the update takes). A
        forward every process makes together when the student is sharded; with gradients on,
        FSDP would wait for a backward that never comes."""
        training = self.parts.config.training
        logprobs_BT = torch.zeros_like(rollouts.sampled_logprobs_BT)
        for substep in contiguous_slices(len(rollouts.prompt_lengths), training.num_substeps):
            part = rollouts.select(substep)
            for rows in self.parts.batching.split(part):
                piece = part.select(rows)
                logprobs, _ = self.parts.policy.sequence_logprobs(
                    piece.input_ids_BT,
                    piece.attention_mask_BT,
                    piece.mask_BT,
                    temperature=training.temperature,
                    chunk_size=training.logprob_chunk_size,
                )
                logprobs_BT[[substep.start + row for row in rows]] = logprobs.to(logprobs_BT.device)
        self.parts.policy.reshard()
        return logprobs_BT

    @torch.no_grad()
    def post_update_kl(self, rollouts: RolloutBatch) -> float:
        """KL(policy before || after) the update, per token, on the batch the student sampled."""
        logprobs = self.policy_logprobs(rollouts)
        mask = rollouts.mask_BT.to(logprobs.device)
        sampled = rollouts.sampled_logprobs_BT.to(logprobs.device)
        kl, tokens = all_reduce([float(((sampled - logprobs) * mask).sum()), float(mask.sum())])
        return kl / max(tokens, 1.0)
