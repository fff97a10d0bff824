"""The synchronous on-policy distillation loop.

Each step: take prompts from every dataset -> the student samples ``group_size``
completions per prompt -> each dataset's teacher scores the same tokens -> advantages are
the negative sampled-token reverse KL -> ``num_substeps`` optimizer steps on the batch.
"""

from __future__ import annotations

import random
import time
import warnings
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml
from peft import LoraConfig, get_peft_model
from tqdm.auto import tqdm

from opd.config import Config, ConfigError, config_to_dict
from opd.data.batching import CompositeBatches
from opd.data.prompts import Prompt, load_prompts
from opd.data.render import ChatRenderer
from opd.logprobs import sequence_logprobs
from opd.models import DTYPES, load_causal_lm, load_tokenizer, warn_if_slow_on_this_cpu
from opd.objectives.advantages import kl_advantages, reverse_kl_per_token
from opd.runs.checkpoints import restore_rng_states, save_checkpoint
from opd.runs.display import colorize_example
from opd.runs.evaluation import EvalSet, evaluate
from opd.runs.graders import grader_for
from opd.runs.loggers import build_loggers, check_loggers
from opd.runs.metrics import JsonlWriter, MetricsWriter
from opd.runs.resume import (
    CONFIG_NAME,
    METRICS_NAME,
    SAMPLES_NAME,
    TIMING_NAME,
    keep_metrics_before,
    load_student_weights,
    prepare_log_path,
)
from opd.runs.timing import SpanRecorder, write_chrome_trace
from opd.sampling.base import Completion
from opd.sampling.hf_generate import HFGenerateSampler
from opd.sampling.precision import SamplingCopy
from opd.trainer.optimizer import build_optimizer
from opd.trainer.rollouts import RolloutBatch, build_rollout_batch
from opd.trainer.sft import completion_tokens
from opd.trainer.teacher_panel import TeacherPanel
from opd.trainer.update import policy_update

PROGRESS_KEYS = ("teacher_kl", "entropy", "kl_sample_train", "completion_len_mean")


@dataclass
class TrainResult:
    """What :func:`train` hands back: the trained student and every step's metrics."""

    student: torch.nn.Module
    tokenizer: object
    renderer: ChatRenderer
    metrics: list[dict] = field(default_factory=list)
    log_path: Path = Path(".")


def step_seed(seed: int, step: int) -> int:
    """Sampling at step ``step`` depends only on (seed, step): a resumed run samples the same."""
    return (seed * 1_000_003 + step) % (2**63)


def default_eval_source(source: str) -> str | None:
    """Generated sources have a held-out ``@test`` split; files need an explicit ``eval_source``."""
    if source.startswith(("demo:", "reasoning_gym:")) and "@" not in source:
        return f"{source}@test"
    return None


def prepare_student(model, config: Config):
    """Wrap in LoRA adapters (``lora_rank > 0``) or leave every weight trainable."""
    student = config.student
    if student.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        if student.lora_rank > 0:
            model.enable_input_require_grads()
    if student.lora_rank == 0:
        model.requires_grad_(True)
        return model
    lora = LoraConfig(
        r=student.lora_rank,
        lora_alpha=student.lora_alpha if student.lora_alpha is not None else student.lora_rank,
        lora_dropout=student.lora_dropout,
        target_modules=student.lora_target_modules,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, lora)


class Trainer:
    """Holds the models, data and optimizer of one run; :meth:`run` trains.

    Construction loads everything and fails early (bad paths, mismatched vocabularies,
    datasets smaller than a batch) before any file in ``log_path`` is written.
    """

    def __init__(self, config: Config, *, progress: bool = True):
        self.config = config
        self.progress = progress
        torch.manual_seed(config.seed)
        student_cfg = config.student
        self.tokenizer = load_tokenizer(
            student_cfg.tokenizer or student_cfg.model,
            "student.model",
            trust_remote_code=student_cfg.trust_remote_code,
        )
        self.vocab_size = len(self.tokenizer)
        base = load_causal_lm(
            student_cfg.model,
            "student.model",
            dtype=student_cfg.dtype,
            device=student_cfg.device,
            trust_remote_code=student_cfg.trust_remote_code,
        )
        generation_eos = base.generation_config.eos_token_id if base.generation_config else None
        extra_stops = generation_eos if isinstance(generation_eos, list) else [generation_eos]
        self.renderer = ChatRenderer(self.tokenizer, student_cfg.chat_template, extra_stop_ids=extra_stops)
        self.student = prepare_student(base, config)
        self.sampler = self._sampler_for(self.student)
        self.sampling_copy: SamplingCopy | None = None
        self.rollout_sampler = self.sampler
        sampling_dtype = DTYPES.get(student_cfg.sampling_dtype)
        student_device = next(base.parameters()).device
        warn_if_slow_on_this_cpu(sampling_dtype, student_device, "student.sampling_dtype")
        warn_if_slow_on_this_cpu(DTYPES.get(config.training.autocast), student_device, "training.autocast")
        if sampling_dtype is not None and (sampling_dtype != base.dtype or student_cfg.lora_rank > 0):
            self.sampling_copy = SamplingCopy(self.student, sampling_dtype)
            self.rollout_sampler = self._sampler_for(self.sampling_copy.model)
        self.datasets = [self._load_dataset(i) for i in range(len(config.datasets))]
        self.batches = CompositeBatches(
            self.datasets,
            [d.groups_per_batch for d in config.datasets],
            [d.name for d in config.datasets],
            config.seed,
        )
        self.teachers = TeacherPanel(config, self.tokenizer, self.renderer, self.sampler.pad_id)
        training = config.training
        if training.objective == "topk_forward_kl" and training.topk > self.vocab_size:
            raise ConfigError(
                f"training.topk: {training.topk} is larger than the vocabulary ({self.vocab_size} tokens)"
            )
        self.eval_sets = self._load_eval_sets()
        check_loggers(config)
        self.spans = SpanRecorder(None)
        self.samples: JsonlWriter | None = None
        self.num_steps = config.training.max_steps or len(self.batches)
        self.optimizer, self.scheduler = build_optimizer(
            self.student, config, self.num_steps * config.training.num_substeps
        )

    def _sampler_for(self, model) -> HFGenerateSampler:
        return HFGenerateSampler(
            model,
            self.tokenizer,
            stop_token_ids=self.renderer.stop_token_ids,
            stop_strings=self.renderer.stop_strings,
        )

    def _load_dataset(self, index: int) -> list[Prompt]:
        dataset = self.config.datasets[index]
        prompts = load_prompts(
            dataset.source, seed=self.config.seed, count=dataset.num_prompts, task_config=dataset.task_config
        )
        return prompts[: dataset.num_prompts] if dataset.num_prompts else prompts

    def _load_eval_sets(self) -> list[EvalSet]:
        eval_sets = []
        for index, dataset in enumerate(self.config.datasets):
            source = dataset.eval_source or default_eval_source(dataset.source)
            if source is None:
                continue
            prompts = load_prompts(
                source, seed=self.config.seed, count=dataset.eval_num_prompts, task_config=dataset.task_config
            )[: dataset.eval_num_prompts]
            grader = grader_for(dataset.grader, source)
            if (
                grader is not None
                and any(p.answer is None for p in prompts)
                and dataset.grader != "reasoning_gym"
            ):
                grader = None
            eval_sets.append(EvalSet(dataset.name, index, prompts, grader, self.teachers.logprobs))
        return eval_sets

    def evaluate(self, step: int | None = None) -> dict[str, float]:
        """``test/*`` metrics of the current student on every dataset's held-out prompts."""
        started = time.perf_counter()
        with self.spans.span(step if step is not None else -1, "eval"):
            metrics = self._evaluate()
        return metrics | {"time/eval": time.perf_counter() - started}

    def _evaluate(self) -> dict[str, float]:
        return evaluate(
            self.sampler,
            self.renderer,
            self.eval_sets,
            temperature=self.config.training.temperature,
            max_tokens=self.config.training.max_tokens,
            seed=self.config.seed,
            pad_id=self.sampler.pad_id,
        )

    def data_source_at(self, step: int) -> str:
        """Who writes step ``step``'s completions: ``student``, ``teacher`` or ``dataset``."""
        source = self.config.training.data_source
        if source == "mixed":
            on_policy = (
                random.Random(f"{self.config.seed}/mixed/{step}").random() < self.config.training.lmbda
            )
            return "student" if on_policy else "teacher"
        return source

    def sample_batch(self, step: int) -> tuple[RolloutBatch, str]:
        """Render the step's prompts and get their completions from the step's data source.

        The student and teachers sample ``group_size`` completions per prompt; a dataset
        gives its one completion per prompt.
        """
        source = self.data_source_at(step)
        items = self.batches.batch(step)
        prompts, targets, dataset_indices, messages = [], [], [], []
        for item in items:
            group_size = 1 if source == "dataset" else self.config.datasets[item.dataset_index].group_size
            if source == "dataset":
                prompt_ids, target = completion_tokens(self.renderer, item.prompt)
                targets.append(Completion(target, [0.0] * len(target), finished=True))
            else:
                prompt_ids = self.renderer.prompt_ids(item.prompt.messages)
            prompts += [prompt_ids] * group_size
            dataset_indices += [item.dataset_index] * group_size
            messages += [item.prompt.messages] * group_size
        torch.manual_seed(step_seed(self.config.seed, step))
        training = self.config.training
        if source == "dataset":
            completions = targets
        elif source == "student":
            with self.sampling_copy.rollout() if self.sampling_copy else nullcontext():
                completions = self.rollout_sampler.sample(
                    prompts, temperature=training.temperature, max_tokens=training.max_tokens
                )
        else:
            completions = self.teachers.sample(
                prompts, dataset_indices, temperature=training.temperature, max_tokens=training.max_tokens
            )
        batch = build_rollout_batch(prompts, completions, dataset_indices, self.sampler.pad_id, messages)
        return batch, source

    def kl_metrics(self, batch: RolloutBatch, reverse_kl_BT: torch.Tensor) -> dict[str, float]:
        """``teacher_kl`` = sum(reverse KL) / completion tokens, overall and per dataset."""
        metrics = {"teacher_kl": float(reverse_kl_BT.sum() / batch.mask_BT.sum().clamp(min=1))}
        for index, dataset in enumerate(self.config.datasets):
            rows = batch.dataset_index_B == index
            tokens = batch.mask_BT[rows].sum()
            if tokens > 0:
                metrics[f"teacher_kl/{dataset.name}"] = float(reverse_kl_BT[rows].sum() / tokens)
        return metrics

    def train_step(self, step: int) -> dict[str, float]:
        """Get completions, score them, compute advantages, update; returns the step's metrics."""
        training = self.config.training
        started = time.perf_counter()
        with self.spans.span(step, "sample"):
            batch, source = self.sample_batch(step)
        sampled_at = time.perf_counter()
        teacher = reverse_kl = None
        if training.objective != "nll":  # SFT reads only the tokens: no teacher forward to pay for
            with self.spans.span(step, "teacher"):
                teacher = self.teachers.score(batch)
        scored_at = time.perf_counter()
        mask = batch.mask_BT
        on_policy = source == "student"
        lengths = mask.sum(-1)
        metrics: dict[str, float] = {"step": step, "on_policy": int(on_policy)}
        if teacher is not None:
            reverse_kl = reverse_kl_per_token(batch.sampled_logprobs_BT, teacher.logprobs_BT, mask)
        if on_policy and reverse_kl is not None:
            metrics |= self.kl_metrics(batch, reverse_kl)
        metrics |= {
            "num_tokens": int(lengths.sum()),
            "num_sequences": int(mask.shape[0]),
            "completion_len_mean": float(lengths.mean()),
            "frac_truncated": float((~batch.finished_B).float().mean()),
            "lr": self.scheduler.get_last_lr()[0],
        }
        if self.samples is not None:
            self.samples.write(self._sample_records(step, batch, reverse_kl))
        if training.show_examples:
            self._print_examples(batch, reverse_kl)
        if (
            teacher is not None and not torch.isfinite(teacher.logprobs_BT[mask.bool()]).all()
        ) or not torch.isfinite(batch.sampled_logprobs_BT[mask.bool()]).all():
            warnings.warn(
                f"step {step}: non-finite log-probs from the sampler or teacher; step skipped", stacklevel=2
            )
            metrics |= {
                "skipped": 1,
                "time/sample": sampled_at - started,
                "time/teacher": scored_at - sampled_at,
            }
            return metrics
        advantages = torch.zeros_like(mask)
        if training.objective == "sampled_reverse_kl":
            advantages = kl_advantages(
                batch.sampled_logprobs_BT,
                teacher.logprobs_BT,
                mask,
                kl_penalty_coef=training.kl_penalty_coef,
                kl_discount_factor=training.kl_discount_factor,
            )
        with self.spans.span(step, "train"):
            stats = policy_update(
                self.student,
                self.optimizer,
                self.scheduler,
                batch,
                teacher,
                advantages,
                training,
                self.vocab_size,
            )
        finished_at = time.perf_counter()
        metrics |= {
            "loss": stats.loss,
            f"objective/{training.objective}": stats.objective_value,
            "entropy": stats.entropy,
            "grad_norm": stats.grad_norm,
            "skipped": int(stats.applied_substeps == 0),
            "time/sample": sampled_at - started,
            "time/teacher": scored_at - sampled_at,
            "time/train": finished_at - scored_at,
            "time/total": finished_at - started,
        }
        if on_policy:
            metrics["kl_sample_train"] = stats.kl_sample_train
            if self.config.compute_post_kl:
                metrics["post_kl"] = self.post_update_kl(batch)
        return metrics

    @torch.no_grad()
    def post_update_kl(self, batch: RolloutBatch) -> float:
        """KL(policy before || after) the update, per token, on the batch the student sampled."""
        device = next(self.student.parameters()).device
        logprobs, _ = sequence_logprobs(
            self.student,
            batch.input_ids_BT.to(device),
            batch.attention_mask_BT.to(device),
            batch.mask_BT.to(device),
            temperature=self.config.training.temperature,
            chunk_size=self.config.training.logprob_chunk_size,
            vocab_size=self.vocab_size,
        )
        mask = batch.mask_BT.to(device)
        return float(
            ((batch.sampled_logprobs_BT.to(device) - logprobs) * mask).sum() / mask.sum().clamp(min=1)
        )

    def _first_row_per_dataset(self, batch: RolloutBatch) -> dict[int, int]:
        rows: dict[int, int] = {}
        for row, dataset_index in enumerate(batch.dataset_index_B.tolist()):
            rows.setdefault(dataset_index, row)
        return rows

    def _sample_records(self, step: int, batch: RolloutBatch, reverse_kl: torch.Tensor | None) -> list[dict]:
        """One sample per dataset for ``samples.jsonl``: prompt, completion tokens, their KL (None in SFT)."""
        records = []
        for dataset_index, row in self._first_row_per_dataset(batch).items():
            length = int(batch.attention_mask_BT[row].sum())
            start = batch.prompt_lengths[row]
            ids = batch.input_ids_BT[row, :length].tolist()
            records.append(
                {
                    "step": step,
                    "dataset": self.config.datasets[dataset_index].name,
                    "prompt": self.tokenizer.decode(ids[:start]),
                    "tokens": [self.tokenizer.decode([t]) for t in ids[start:]],
                    "token_kl": None
                    if reverse_kl is None
                    else [round(float(v), 4) for v in reverse_kl[row, start:length]],
                }
            )
        return records

    def _print_examples(self, batch: RolloutBatch, reverse_kl: torch.Tensor | None) -> None:
        for dataset_index, row in self._first_row_per_dataset(batch).items():
            length = int(batch.attention_mask_BT[row].sum())
            text = colorize_example(
                self.tokenizer,
                batch.input_ids_BT[row, :length].tolist(),
                batch.mask_BT[row, :length].tolist(),
                None if reverse_kl is None else reverse_kl[row],
            )
            tqdm.write(f"--- {self.config.datasets[dataset_index].name}\n{text}")

    def run(self) -> TrainResult:
        """Train from the start point ``log_path`` dictates up to ``num_steps``, checkpointing on the way."""
        log_path = Path(self.config.log_path)
        start = prepare_log_path(self.config)
        if start.model_dir is not None:
            load_student_weights(self.student, start.model_dir)
            self.optimizer.load_state_dict(start.trainer_state["optimizer"])
            self.scheduler.load_state_dict(start.trainer_state["scheduler"])
            restore_rng_states(start.trainer_state["rng"])
        elif self.config.load_checkpoint_path:
            load_student_weights(self.student, Path(self.config.load_checkpoint_path).expanduser())
        (log_path / CONFIG_NAME).write_text(yaml.safe_dump(config_to_dict(self.config), sort_keys=False))
        result = TrainResult(self.student, self.tokenizer, self.renderer, log_path=log_path)
        if start.step >= self.num_steps:
            tqdm.write(f"{log_path}: training already complete ({start.step} steps); nothing to do")
            return result
        for name in (METRICS_NAME, SAMPLES_NAME):
            keep_metrics_before(log_path / name, start.step)
        eval_every = self.config.eval_every if self.eval_sets else 0
        writer = MetricsWriter(log_path / METRICS_NAME)
        loggers = build_loggers(self.config)
        self.samples = JsonlWriter(log_path / SAMPLES_NAME)
        self.spans = SpanRecorder(log_path / TIMING_NAME)
        checkpoint_seconds = None
        bar = tqdm(
            total=self.num_steps,
            initial=start.step,
            desc="opd",
            disable=not self.progress,
            dynamic_ncols=True,
        )
        try:
            for step in range(start.step, self.num_steps):
                evaluation = self.evaluate(step) if eval_every and step % eval_every == 0 else {}
                metrics = self.train_step(step) | evaluation
                if checkpoint_seconds is not None:
                    metrics["time/checkpoint"], checkpoint_seconds = checkpoint_seconds, None
                metrics["progress/done_frac"] = (step + 1) / self.num_steps
                writer.write(metrics)
                for logger in loggers:
                    logger.log(metrics, step)
                result.metrics.append(metrics)
                bar.set_postfix(
                    {k: f"{metrics[k]:.3g}" for k in PROGRESS_KEYS if k in metrics}, refresh=False
                )
                bar.update(1)
                done = step + 1
                if done == self.num_steps and eval_every:
                    final = {"step": done} | self.evaluate(done)
                    writer.write(final)
                    for logger in loggers:
                        logger.log(final, done)
                    result.metrics.append(final)
                if done == self.num_steps or (self.config.save_every and done % self.config.save_every == 0):
                    saving = time.perf_counter()
                    with self.spans.span(step, "checkpoint"):
                        self.save_checkpoint(done)
                    checkpoint_seconds = time.perf_counter() - saving
        finally:
            bar.close()
            writer.close()
            for logger in loggers:
                logger.close()
            self.samples.close()
            self.spans.close()
            self.samples, self.spans = None, SpanRecorder(None)
        if self.config.trace:
            write_chrome_trace(log_path / TIMING_NAME, log_path / "trace.json")
        return result

    def save_checkpoint(self, steps_done: int) -> None:
        """Weights, optimizer, scheduler and RNG states after ``steps_done`` steps, written atomically."""
        save_checkpoint(
            Path(self.config.log_path),
            steps_done,
            self.student,
            self.tokenizer,
            {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()},
        )


def train(config: Config, *, progress: bool = True) -> TrainResult:
    """Run on-policy distillation as configured; the Python twin of ``opd train``."""
    return Trainer(config, progress=progress).run()
