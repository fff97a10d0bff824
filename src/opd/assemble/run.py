"""Everything a run trains with, built from its config in one place: :func:`assemble_run`.

It loads everything and fails early (bad paths, mismatched vocabularies, datasets smaller than a
batch, options that do not fit the vocabulary) before any file in ``log_path`` is written; what
it returns, :class:`RunComponents`, is plain data that the collector, the learner and the
checkpointer each read what they need from.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from opd.assemble.eval_sets import load_eval_sets
from opd.assemble.micro_batching import (
    MicroBatching,
    activation_bytes_per_token,
    device_memory,
    resolve_token_budget,
    sized_budget,
)
from opd.assemble.optimizer import build_optimizer
from opd.assemble.processes import (
    check_processes,
    for_this_process,
    shards_its_teacher,
    step_group_sizes,
)
from opd.assemble.student import load_student
from opd.assemble.teachers import load_teachers
from opd.config import Config
from opd.data.batching import CompositeBatches, rank_rows
from opd.data.graders import Grader, grader_of
from opd.data.prompts import Prompt
from opd.data.render import ChatRenderer
from opd.data.sources import load_prompts
from opd.data.tables import TableOptions
from opd.distributed import World, init_from_env, launched_world
from opd.envs.base import Environment
from opd.envs.registry import make_environment
from opd.errors import ConfigError
from opd.models import DTYPES, resolve_device, warn_if_slow_on_this_cpu
from opd.objectives.base import Objective
from opd.policy.parallel import parallel_mode
from opd.policy.policy import Policy
from opd.runs.evaluation import EvalSet
from opd.runs.loggers import check_loggers
from opd.runs.resume import resumed_model_dir
from opd.runs.sharded_state import has_sharded_state, load_sharded_state
from opd.sampling.base import RolloutEngine, Sampler
from opd.sampling.engines import build_rollout_engine
from opd.sampling.hf_generate import HFEngine
from opd.teachers.panel import TeacherPanel


@dataclass
class RunComponents:
    """A run's parts, as :func:`assemble_run` builds them."""

    config: Config
    world: World
    """This process's place in the run (one process: rank 0 of 1)."""
    objective: Objective
    tokenizer: Any
    policy: Policy
    """The student, its adapters and its parallel mode."""
    renderer: ChatRenderer
    resumed_model_dir: Path | None
    """The one-process checkpoint the run resumes from, whose weights are already loaded (a
    sharded one's are loaded by :meth:`opd.trainer.checkpointing.Checkpointer.restore`)."""
    datasets: list[list[Prompt]]
    graders: list[Grader | None]
    environments: list[Environment | None]
    """Each dataset's environment (None: one turn), each tried on its first prompt already."""
    batching: MicroBatching
    """The update's micro-batches (a token budget or rows; packed or padded)."""
    engine: RolloutEngine
    """Samples the student's rollouts (from the student, a sampling copy or vLLM)."""
    ahead_engine: RolloutEngine | None
    """With ``max_staleness`` > 0: the worker's engine, which samples published weights only."""
    sampler: Sampler
    """Decodes for evaluation: the engine where it serves evaluation (vLLM, or the copy of a
    sharded student), else the student."""
    batches: CompositeBatches
    rank_rows: list[int]
    """The rows of each step's batch that this process samples."""
    teachers: TeacherPanel
    teacher_writers: list
    """Write completions for the off-policy data sources, one per dataset (shared where teacher
    and format are)."""
    eval_sets: list[EvalSet]
    num_steps: int
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR

    @property
    def student(self) -> torch.nn.Module:
        """The student's Hugging Face model (PEFT-wrapped under LoRA)."""
        return self.policy.model


def assemble_run(config: Config) -> RunComponents:
    """Build every part of the run ``config`` describes, checking each as it comes.

    Under torchrun the process joins its group first (:mod:`opd.distributed`) and each process
    loads its models on its own device. A one-process checkpoint the run resumes from has its
    weights loaded before the student is sharded.
    """
    student_cfg, training = config.student, config.training
    launched = launched_world()
    parallel = check_processes(config, launched.size)
    process_config = for_this_process(config, launched)
    world = init_from_env(
        training.dist_backend,
        resolve_device(process_config.student.device),
        training.dist_timeout_s,
    )
    student = load_student(process_config)
    policy, renderer = student.policy, student.renderer
    resumed = resumed_model_dir(config)
    load_from = resumed or (
        Path(config.load_checkpoint_path).expanduser() if config.load_checkpoint_path else None
    )
    if load_from is not None and not has_sharded_state(load_from):
        policy.load_weights(load_from)
    datasets = [_load_dataset(config, i) for i in range(len(config.datasets))]
    for index, prompts in enumerate(datasets):
        _check_context(config, index, prompts, config.datasets[index].source)
    graders = [
        grader_of(d.grader, d.source, prompts)
        for d, prompts in zip(config.datasets, datasets, strict=True)
    ]
    environments = _environments(config, datasets, graders)
    if training.reward_coef:
        _check_rewards(config, graders, environments)
    batching = _micro_batching(config, policy, renderer, datasets)
    warn_if_slow_on_this_cpu(
        DTYPES.get(student_cfg.sampling_dtype), policy.device, "student.sampling_dtype"
    )
    warn_if_slow_on_this_cpu(DTYPES.get(training.autocast), policy.device, "training.autocast")
    policy.parallel = parallel_mode(parallel)
    engine = build_rollout_engine(
        student_cfg, policy, student.tokenizer, renderer, seed=config.seed
    )
    ahead_engine = None
    if training.max_staleness:
        # vLLM's engine takes published weights pushed into it; HF needs a copy to hold them
        ahead_engine = (
            HFEngine(
                policy,
                student.tokenizer,
                stop_token_ids=renderer.stop_token_ids,
                stop_strings=renderer.stop_strings,
                sampling_dtype=DTYPES.get(student_cfg.sampling_dtype),
                copy=True,
            )
            if isinstance(engine, HFEngine)
            else engine
        )
    policy.parallelize()
    if load_from is not None and resumed is None and has_sharded_state(load_from):
        load_sharded_state(load_from, policy)
    batches = CompositeBatches(
        datasets,
        [d.groups_per_batch for d in config.datasets],
        [d.name for d in config.datasets],
        config.seed,
    )
    teachers = load_teachers(
        process_config,
        student,
        engine.pad_id,
        training.objective.teacher_request(training.temperature),
        token_budget=batching.tokens,
        parallel=parallel,
    )
    if shards_its_teacher(config, parallel):
        teachers.per_dataset[0].shard(policy.parallel)
    eval_sets = load_eval_sets(config, teachers.logprobs, environments)
    for eval_set in eval_sets:
        where = config.datasets[eval_set.dataset_index].eval_source or "its held-out prompts"
        _check_context(config, eval_set.dataset_index, eval_set.prompts, where)
    check_loggers(config)
    num_steps = training.max_steps or len(batches)
    optimizer, scheduler = build_optimizer(
        policy.trainable_parameters(), training, num_steps * training.num_substeps
    )
    return RunComponents(
        config=config,
        world=world,
        objective=training.objective,
        tokenizer=student.tokenizer,
        policy=policy,
        renderer=renderer,
        resumed_model_dir=resumed,
        datasets=datasets,
        graders=graders,
        environments=environments,
        batching=batching,
        engine=engine,
        ahead_engine=ahead_engine,
        sampler=engine if engine.serves_evaluation else student.sampler_for(policy.model),
        batches=batches,
        rank_rows=rank_rows(
            step_group_sizes(config), training.num_substeps, world.size, world.rank
        ),
        teachers=teachers,
        teacher_writers=teachers.writers(),
        eval_sets=eval_sets,
        num_steps=num_steps,
        optimizer=optimizer,
        scheduler=scheduler,
    )


def _micro_batching(
    config: Config, policy: Policy, renderer: ChatRenderer, datasets: list[list[Prompt]]
) -> MicroBatching:
    """The update's micro-batches: rows when only ``micro_batch_size`` is set; else the token
    budget checked against the longest prompt (rendered as the student sees it) plus
    ``max_tokens`` before any other work, or sized for the device; packed unless the config or
    the student's model says otherwise (said once)."""
    training = config.training
    problem = policy.use_packing(training.packing)
    if problem and launched_world().is_main:
        warnings.warn(
            f"training.packing: {problem}; the student's micro-batches run padded", stacklevel=3
        )
    if training.micro_batch_tokens is None and training.micro_batch_size is not None:
        return MicroBatching(None, training.micro_batch_size, policy.packed)  # rows: no budget
    longest_prompt = max(
        (len(renderer.prompt_ids(prompt.messages)) for prompts in datasets for prompt in prompts),
        default=0,
    )

    def size_for_device() -> int:
        element_bytes = 2 if training.autocast else policy.dtype.itemsize
        per_token = activation_bytes_per_token(
            policy.base_model.config,
            element_bytes,
            policy.has_adapters,
            config.student.gradient_checkpointing,
        )
        return sized_budget(device_memory(policy.device), per_token)

    tokens = resolve_token_budget(
        training, longest_prompt, size_for_device, _longest_completion(config)
    )
    return MicroBatching(tokens, training.micro_batch_size, policy.packed)


def _longest_completion(config: Config) -> tuple[int, str]:
    """The most tokens a row's completion can have, and the setting that says so."""
    max_tokens = config.training.max_tokens
    bounds = [(max_tokens, "training.max_tokens")] + [
        (dataset.env.episode_tokens(max_tokens), f"datasets[{index}].env's episode budget")
        for index, dataset in enumerate(config.datasets)
        if dataset.env is not None
    ]
    return max(bounds, key=lambda bound: bound[0])


def _check_rewards(
    config: Config, graders: list[Grader | None], environments: list[Environment | None]
) -> None:
    """With ``reward_coef`` > 0 every dataset must give its samples a reward (a grader, or an
    environment), before any step."""
    for index, dataset in enumerate(config.datasets):
        if graders[index] is None and environments[index] is None:
            why = (
                "grader: none" if dataset.grader == "none" else "some of its prompts have no answer"
            )
            raise ConfigError(
                f"datasets[{index}] ({dataset.name}): training.reward_coef > 0 needs a reward "
                f"for its samples, and it has no grader ({why}) and no env; give its prompts "
                "answers and a grader, or an env, or set reward_coef: 0"
            )


def _environments(
    config: Config, datasets: list[list[Prompt]], graders: list[Grader | None]
) -> list[Environment | None]:
    """Each dataset's environment (None: one turn), each tried on its first prompt now, so that
    one that cannot start stops the run before any work."""
    environments: list[Environment | None] = []
    for index, dataset in enumerate(config.datasets):
        if dataset.env is None:
            environments.append(None)
            continue
        environment = make_environment(dataset.env, f"datasets[{index}].env")
        try:
            environment.start(datasets[index][0], graders[index])
        except Exception as error:
            raise ConfigError(
                f"datasets[{index}].env: environment {dataset.env.name!r} cannot start an "
                f"episode of {dataset.source}: {type(error).__name__}: {error}"
            ) from None
        environments.append(environment)
    return environments


def _check_context(config: Config, index: int, prompts: list[Prompt], where: str) -> None:
    """Refuse a dataset whose prompts lack a field its teacher's privileged context reads."""
    dataset = config.datasets[index]
    teacher = config.teacher_for(dataset)
    for number, (member, _) in enumerate(teacher.members):
        context = member.privileged_context
        if context is not None and (problem := context.missing(prompts, where)):
            field = f"datasets[{index}].teacher" if dataset.teacher else "teacher"
            field += "" if teacher.mixture is None else f".mixture[{number}]"
            raise ConfigError(f"{field}.context: {problem}")


def _load_dataset(config: Config, index: int) -> list[Prompt]:
    dataset = config.datasets[index]
    prompts = load_prompts(
        dataset.source,
        seed=config.seed,
        count=dataset.num_prompts,
        task_config=dataset.task_config,
        table=TableOptions(dataset.split, dataset.subset, dataset.fields),
    )
    return prompts[: dataset.num_prompts] if dataset.num_prompts else prompts
