"""Everything a run trains with, built from its config: the set-up that precedes the loop.

Construction loads everything and fails early (bad paths, mismatched vocabularies, datasets
smaller than a batch, options that do not fit the vocabulary) before any file in ``log_path``
is written.
"""

from __future__ import annotations

import torch

from opd.config import Config
from opd.data.batching import CompositeBatches
from opd.data.prompts import Prompt, load_prompts
from opd.models import DTYPES, warn_if_slow_on_this_cpu
from opd.runs.evaluation import load_eval_sets
from opd.runs.loggers import check_loggers
from opd.runs.setup import load_student, load_teachers
from opd.sampling.base import Sampler
from opd.sampling.engines import build_rollout_engine
from opd.teachers.local import LocalTeacher
from opd.trainer.optimizer import build_optimizer


class RunComponents:
    """The student (:attr:`policy`), its rollout engine, the teachers, the data and the optimizer.

    ``engine`` samples the student's rollouts (from the student, a sampling copy or vLLM);
    ``sampler`` decodes for evaluation: the engine itself where it can (vLLM), else the student;
    ``teacher_samplers`` write completions for the off-policy data sources, one per local teacher.
    """

    def __init__(self, config: Config):
        self.config = config
        student_cfg, training = config.student, config.training
        self.objective = training.objective
        student = load_student(config)
        self.tokenizer, self.policy, self.renderer = student.tokenizer, student.policy, student.renderer
        self.policy.parallelize()
        self.vocab_size = len(self.tokenizer)
        device = self.policy.device
        warn_if_slow_on_this_cpu(DTYPES.get(student_cfg.sampling_dtype), device, "student.sampling_dtype")
        warn_if_slow_on_this_cpu(DTYPES.get(training.autocast), device, "training.autocast")
        self.engine = build_rollout_engine(
            student_cfg, self.policy, self.tokenizer, self.renderer, seed=config.seed
        )
        self.sampler = (
            self.engine if isinstance(self.engine, Sampler) else student.sampler_for(self.policy.model)
        )
        self.datasets = [self._load_dataset(i) for i in range(len(config.datasets))]
        self.batches = CompositeBatches(
            self.datasets,
            [d.groups_per_batch for d in config.datasets],
            [d.name for d in config.datasets],
            config.seed,
        )
        request = self.objective.teacher_request(training.temperature)
        self.teachers = load_teachers(config, student, self.engine.pad_id, request)
        self.teacher_samplers = {
            id(teacher): student.sampler_for(teacher.model)
            for teacher in self.teachers.per_dataset
            if isinstance(teacher, LocalTeacher)
        }
        self.eval_sets = load_eval_sets(config, self.teachers.logprobs)
        check_loggers(config)
        self.num_steps = training.max_steps or len(self.batches)
        self.optimizer, self.scheduler = build_optimizer(
            self.policy.trainable_parameters(), training, self.num_steps * training.num_substeps
        )

    @property
    def student(self) -> torch.nn.Module:
        """The student's Hugging Face model (PEFT-wrapped under LoRA)."""
        return self.policy.model

    def _load_dataset(self, index: int) -> list[Prompt]:
        dataset = self.config.datasets[index]
        prompts = load_prompts(
            dataset.source, seed=self.config.seed, count=dataset.num_prompts, task_config=dataset.task_config
        )
        return prompts[: dataset.num_prompts] if dataset.num_prompts else prompts
