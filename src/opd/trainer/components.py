"""Everything a run trains with, built from its config: the set-up that precedes the loop.

Construction loads everything and fails early (bad paths, mismatched vocabularies, datasets
smaller than a batch, options that do not fit the vocabulary) before any file in ``log_path``
is written.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from opd.assemble.eval_sets import load_eval_sets
from opd.assemble.student import load_student
from opd.assemble.teachers import load_teachers
from opd.config import Config
from opd.data.batching import CompositeBatches, rank_rows
from opd.data.graders import grader_of
from opd.data.prompts import Prompt
from opd.data.sources import load_prompts
from opd.data.tables import TableOptions
from opd.distributed import init_from_env, launched_world
from opd.envs.base import Environment
from opd.envs.registry import make_environment
from opd.errors import ConfigError
from opd.models import DTYPES, resolve_device, warn_if_slow_on_this_cpu
from opd.policy.parallel import parallel_mode
from opd.runs.loggers import check_loggers
from opd.runs.resume import resumed_model_dir
from opd.runs.sharded_state import has_sharded_state, load_sharded_state
from opd.sampling.engines import build_rollout_engine
from opd.sampling.hf_generate import HFEngine
from opd.trainer.micro_batching import (
    MicroBatching,
    activation_bytes_per_token,
    device_memory,
    resolve_token_budget,
    sized_budget,
)
from opd.trainer.optimizer import build_optimizer
from opd.trainer.processes import (
    check_processes,
    for_this_process,
    shards_its_teacher,
    step_group_sizes,
)


class RunComponents:
    """The student (:attr:`policy`), its rollout engine, the teachers, the data and the optimizer.

    ``engine`` samples the student's rollouts (from the student, a sampling copy or vLLM);
    ``sampler`` decodes for evaluation: the engine where it serves evaluation (vLLM, or the
    copy of a sharded student), else the student; ``teacher_writers`` write completions for
    the off-policy data sources, one per dataset (shared where teacher and format are);
    ``ahead_engine`` (``max_staleness`` > 0) is the worker's sampling copy, which samples
    published weights only. Under torchrun the process joins its group first
    (:mod:`opd.distributed`) and each process loads its models on its own device.
    A one-process checkpoint the run resumes from (``resumed_model_dir``) has its weights loaded
    before the student is sharded; a sharded one's are loaded by
    :meth:`opd.trainer.checkpointing.Checkpointer.restore`.
    """

    def __init__(self, config: Config):
        self.config = config
        student_cfg, training = config.student, config.training
        launched = launched_world()
        parallel = check_processes(config, launched.size)
        process_config = for_this_process(config, launched)
        device = resolve_device(process_config.student.device)
        self.world = init_from_env(training.dist_backend, device, training.dist_timeout_s)
        self.objective = training.objective
        student = load_student(process_config)
        self.tokenizer, self.policy, self.renderer = (
            student.tokenizer,
            student.policy,
            student.renderer,
        )
        self.resumed_model_dir = resumed_model_dir(config)
        load_from = self.resumed_model_dir or (
            Path(config.load_checkpoint_path).expanduser() if config.load_checkpoint_path else None
        )
        if load_from is not None and not has_sharded_state(load_from):
            self.policy.load_weights(load_from)
        self.vocab_size = len(self.tokenizer)
        device = self.policy.device
        self.datasets = [self._load_dataset(i) for i in range(len(config.datasets))]
        for index, prompts in enumerate(self.datasets):
            self._check_context(index, prompts, config.datasets[index].source)
        self.graders = [
            grader_of(d.grader, d.source, prompts)
            for d, prompts in zip(config.datasets, self.datasets, strict=True)
        ]
        self.environments = self._environments()
        if training.reward_coef:
            self._check_rewards()
        self.batching = self._micro_batching()
        warn_if_slow_on_this_cpu(
            DTYPES.get(student_cfg.sampling_dtype), device, "student.sampling_dtype"
        )
        warn_if_slow_on_this_cpu(DTYPES.get(training.autocast), device, "training.autocast")
        self.policy.parallel = parallel_mode(parallel)
        self.engine = build_rollout_engine(
            student_cfg, self.policy, self.tokenizer, self.renderer, seed=config.seed
        )
        self.ahead_engine = None
        if training.max_staleness:
            # vLLM's engine takes published weights pushed into it; HF needs a copy to hold them
            self.ahead_engine = (
                HFEngine(
                    self.policy,
                    self.tokenizer,
                    stop_token_ids=self.renderer.stop_token_ids,
                    stop_strings=self.renderer.stop_strings,
                    sampling_dtype=DTYPES.get(student_cfg.sampling_dtype),
                    copy=True,
                )
                if isinstance(self.engine, HFEngine)
                else self.engine
            )
        self.policy.parallelize()
        if (
            load_from is not None
            and self.resumed_model_dir is None
            and has_sharded_state(load_from)
        ):
            load_sharded_state(load_from, self.policy)
        self.sampler = (
            self.engine if self.engine.serves_evaluation else student.sampler_for(self.policy.model)
        )
        self.batches = CompositeBatches(
            self.datasets,
            [d.groups_per_batch for d in config.datasets],
            [d.name for d in config.datasets],
            config.seed,
        )
        self.rank_rows = rank_rows(
            step_group_sizes(config), training.num_substeps, self.world.size, self.world.rank
        )
        request = self.objective.teacher_request(training.temperature)
        self.teachers = load_teachers(
            process_config,
            student,
            self.engine.pad_id,
            request,
            token_budget=self.batching.tokens,
            parallel=parallel,
        )
        if shards_its_teacher(config, parallel):
            self.teachers.per_dataset[0].shard(self.policy.parallel)
        self.teacher_writers = self.teachers.writers()
        self.eval_sets = load_eval_sets(config, self.teachers.logprobs, self.environments)
        for eval_set in self.eval_sets:
            where = config.datasets[eval_set.dataset_index].eval_source or "its held-out prompts"
            self._check_context(eval_set.dataset_index, eval_set.prompts, where)
        check_loggers(config)
        self.num_steps = training.max_steps or len(self.batches)
        self.optimizer, self.scheduler = build_optimizer(
            self.policy.trainable_parameters(), training, self.num_steps * training.num_substeps
        )

    @property
    def student(self) -> torch.nn.Module:
        """The student's Hugging Face model (PEFT-wrapped under LoRA)."""
        return self.policy.model

    def _micro_batching(self) -> MicroBatching:
        """The update's micro-batches: rows when only ``micro_batch_size`` is set; else the token
        budget checked against the longest prompt (rendered as the student sees it) plus
        ``max_tokens`` before any other work, or sized for the device; packed unless the config or
        the student's model says otherwise (said once)."""
        training = self.config.training
        problem = self.policy.use_packing(training.packing)
        if problem and launched_world().is_main:
            warnings.warn(
                f"training.packing: {problem}; the student's micro-batches run padded", stacklevel=2
            )
        if training.micro_batch_tokens is None and training.micro_batch_size is not None:
            return MicroBatching(
                None, training.micro_batch_size, self.policy.packed
            )  # rows: no budget
        longest_prompt = max(
            (
                len(self.renderer.prompt_ids(prompt.messages))
                for prompts in self.datasets
                for prompt in prompts
            ),
            default=0,
        )

        def size_for_device() -> int:
            model, lora = self.policy.base_model, self.policy.has_adapters
            element_bytes = 2 if training.autocast else self.policy.dtype.itemsize
            per_token = activation_bytes_per_token(
                model.config, element_bytes, lora, self.config.student.gradient_checkpointing
            )
            return sized_budget(device_memory(self.policy.device), per_token)

        tokens = resolve_token_budget(
            training, longest_prompt, size_for_device, self._longest_completion()
        )
        return MicroBatching(tokens, training.micro_batch_size, self.policy.packed)

    def _longest_completion(self) -> tuple[int, str]:
        """The most tokens a row's completion can have, and the setting that says so."""
        max_tokens = self.config.training.max_tokens
        bounds = [(max_tokens, "training.max_tokens")] + [
            (dataset.env.episode_tokens(max_tokens), f"datasets[{index}].env's episode budget")
            for index, dataset in enumerate(self.config.datasets)
            if dataset.env is not None
        ]
        return max(bounds, key=lambda bound: bound[0])

    def _check_rewards(self) -> None:
        """With ``reward_coef`` > 0 every dataset must give its samples a reward (a grader, or an
        environment), before any step."""
        for index, dataset in enumerate(self.config.datasets):
            if self.graders[index] is None and self.environments[index] is None:
                why = (
                    "grader: none"
                    if dataset.grader == "none"
                    else "some of its prompts have no answer"
                )
                raise ConfigError(
                    f"datasets[{index}] ({dataset.name}): training.reward_coef > 0 needs a reward "
                    f"for its samples, and it has no grader ({why}) and no env; give its prompts "
                    "answers and a grader, or an env, or set reward_coef: 0"
                )

    def _environments(self) -> list[Environment | None]:
        """Each dataset's environment (None: one turn), each tried on its first prompt now, so that
        one that cannot start stops the run before any work."""
        environments: list[Environment | None] = []
        for index, dataset in enumerate(self.config.datasets):
            if dataset.env is None:
                environments.append(None)
                continue
            environment = make_environment(dataset.env, f"datasets[{index}].env")
            try:
                environment.start(self.datasets[index][0], self.graders[index])
            except Exception as error:
                raise ConfigError(
                    f"datasets[{index}].env: environment {dataset.env.name!r} cannot start an "
                    f"episode of {dataset.source}: {type(error).__name__}: {error}"
                ) from None
            environments.append(environment)
        return environments

    def _check_context(self, index: int, prompts: list[Prompt], where: str) -> None:
        """Refuse a dataset whose prompts lack a field its teacher's privileged context reads."""
        dataset = self.config.datasets[index]
        teacher = self.config.teacher_for(dataset)
        for number, (member, _) in enumerate(teacher.members):
            context = member.privileged_context
            if context is not None and (problem := context.missing(prompts, where)):
                field = f"datasets[{index}].teacher" if dataset.teacher else "teacher"
                field += "" if teacher.mixture is None else f".mixture[{number}]"
                raise ConfigError(f"{field}.context: {problem}")

    def _load_dataset(self, index: int) -> list[Prompt]:
        dataset = self.config.datasets[index]
        prompts = load_prompts(
            dataset.source,
            seed=self.config.seed,
            count=dataset.num_prompts,
            task_config=dataset.task_config,
            table=TableOptions(dataset.split, dataset.subset, dataset.fields),
        )
        return prompts[: dataset.num_prompts] if dataset.num_prompts else prompts
