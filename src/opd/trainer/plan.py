"""``opd train CONFIG --dry-run``: what a run would do on N processes, without loading a weight.

The config is resolved and checked against the world size as a launch would check it; the
models' sizes come from their config files alone (each model built on PyTorch's meta device, so
the parameter counts are exact and cost no memory), and the memory each device needs for
weights, gradients and optimizer state is estimated from them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from opd.assemble.micro_batching import activation_bytes_per_token, device_memory, sized_budget
from opd.assemble.processes import check_processes, shards_its_teacher, step_group_sizes
from opd.assemble.teachers import run_teachers, teacher_is_the_students_base
from opd.config import Config, StudentSection, TrainingConfig
from opd.errors import ModelLoadError
from opd.models import model_source
from opd.policy.parallel import parallel_mode
from opd.sampling.vllm_settings import GPU_MEMORY_UTILIZATION
from opd.teachers.config import TeacherConfig

GB = 1e9
ADAM_STATES = 2
"""AdamW keeps two tensors per trainable weight (first and second moments), in the weight's
dtype."""
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class ModelSize:
    """A model's parameter count and what LoRA of a given rank would train of it."""

    parameters: int
    lora_parameters: int
    config: object
    """The model's Hugging Face config (its shape sizes the micro-batches)."""


def model_size(name: str, field: str, *, lora_rank: int, trust_remote_code: bool) -> ModelSize:
    """Counted on the meta device from the model's config file (a local path, the Hugging Face
    cache, or the hub): exact, and no weight is read."""
    from transformers import AutoConfig, AutoModelForCausalLM

    source, cached_only = model_source(name, field)
    try:
        config = AutoConfig.from_pretrained(
            source, trust_remote_code=trust_remote_code, local_files_only=cached_only
        )
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"{field}: cannot read the config of '{name}': {error}") from None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    parameters = sum(p.numel() for p in model.parameters())
    head = model.get_output_embeddings()
    lora = sum(
        lora_rank * (module.in_features + module.out_features)
        for module in model.modules()
        if isinstance(module, torch.nn.Linear) and module is not head
    )
    return ModelSize(parameters, lora, config)


def dtype_name(dtype: str, device: str) -> str:
    """The dtype ``auto`` means on ``device`` (``auto``: bfloat16 where a GPU is, float32 on a
    CPU)."""
    if dtype != "auto":
        return dtype
    gpu = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    return "bfloat16" if gpu else "float32"


def devices(device: str, processes: int) -> str:
    if device == "auto":
        where = "cuda" if torch.cuda.is_available() else "cpu (no GPU on this machine)"
        return f"auto: {where}" + (
            ", one GPU per process (cuda:LOCAL_RANK)" if processes > 1 else ""
        )
    return device


def billions(count: int) -> str:
    """``1,720,574,976 (1.72B)``: exact, and at a glance."""
    short = f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.1f}M"
    return f"{count:,} ({short})"


def micro_batch_line(
    training: TrainingConfig, size: ModelSize, dtype: str, student: StudentSection
) -> str:
    """How the update's forwards are cut: the budget set, rows, or the budget a run would size."""
    how = "packed" if training.packing else "padded"
    if training.micro_batch_tokens is not None:
        budget = training.micro_batch_tokens
        return f"at most {budget} tokens each (training.micro_batch_tokens), {how}"
    if training.micro_batch_size is not None:
        return (
            f"at most {training.micro_batch_size} sequences each (training.micro_batch_size), {how}"
        )
    element_bytes = 2 if training.autocast else BYTES[dtype]
    per_token = activation_bytes_per_token(
        size.config, element_bytes, student.lora_rank > 0, student.gradient_checkpointing
    )
    gpu = student.device.startswith("cuda") or student.device == "auto"
    if gpu and not torch.cuda.is_available():
        tokens = sized_budget(80 * 2**30, per_token)
        return (
            f"sized when the run starts: a quarter of each GPU's memory at ~{per_token / 1e6:.2f} "
            f"MB of activations a token (an 80 GiB GPU: {tokens} tokens), {how}"
        )
    where = torch.device("cuda" if gpu else "cpu")
    memory = device_memory(where)
    tokens = sized_budget(memory, per_token)
    return (
        f"at most {tokens} tokens each: a quarter of this {where.type.upper()}'s "
        f"{memory / 2**30:.0f} GiB at ~{per_token / 1e6:.2f} MB of activations a token (raised to "
        f"the longest row if longer), {how}"
    )


def teacher_line(
    teacher: TeacherConfig, size: ModelSize | None, sharded: bool, processes: int
) -> str:
    if teacher.backend != "local":
        return f"{teacher.model} on {teacher.base_url} ({teacher.backend} server: no memory here)"
    dtype = dtype_name(teacher.dtype, teacher.device)
    how = (
        f"sharded with the student over {processes} processes"
        if sharded
        else "a whole copy in every process"
    )
    count = f"{billions(size.parameters)} parameters, " if size else ""
    return f"{teacher.model}: {count}{dtype}, {how}"


def describe_plan(config: Config, processes: int) -> str:
    """The plan of ``config`` on ``processes`` processes, as the lines ``--dry-run`` prints; a
    config that cannot run on them raises the error the launch would."""
    parallel = check_processes(config, processes)
    student, training = config.student, config.training
    lines = [
        f"processes      {processes}"
        + (f" (training.parallel: {parallel})" if processes > 1 else "")
    ]
    lines.append(f"devices        {devices(student.device, processes)}")
    student_size = model_size(
        student.model,
        "student.model",
        lora_rank=student.lora_rank,
        trust_remote_code=student.trust_remote_code,
    )
    dtype = dtype_name(student.dtype, student.device)
    trainable = student_size.lora_parameters if student.lora_rank else student_size.parameters
    mode = (
        f"LoRA rank {student.lora_rank}: {billions(trainable)} trained"
        if student.lora_rank
        else "full fine-tune"
    )
    sharing = parallel_mode(parallel)
    sharded, where = sharing.shards, sharing.placement(processes)
    size = billions(student_size.parameters)
    lines.append(f"student        {student.model}: {size} parameters, {dtype}, {mode}, {where}")
    teacher_sharded = shards_its_teacher(config, parallel)
    teachers = {
        (id(config.teacher_for(d)), number): (member, weight, t.mixture is not None)
        for d, t in zip(config.datasets, run_teachers(config), strict=True)
        for number, (member, weight) in enumerate(t.members)
    }
    teacher_sizes = {}
    shared = teacher_is_the_students_base(config, parallel)
    for key, (teacher, weight, mixed) in teachers.items():
        size = None
        share = f"weight {weight:g} of a mixture: " if mixed else ""
        if shared and teacher.backend == "local" and teacher.model == student.model:
            teacher_sizes[key] = None
            lines.append(
                f"teacher        {share}the student with its LoRA adapters off: no second copy"
            )
            continue
        if teacher.backend == "local":
            size = model_size(
                teacher.model,
                "teacher.model",
                lora_rank=0,
                trust_remote_code=teacher.trust_remote_code,
            )
        teacher_sizes[key] = size
        lines.append(
            f"teacher        {share}{teacher_line(teacher, size, teacher_sharded, processes)}"
        )
    sampler = student.sampler
    lines.append(f"sampler        {student.plan_line()}")
    sequences = sum(step_group_sizes(config))
    lines.append(
        f"per step       {sequences} sequences ({sequences // processes} per process), up to "
        f"{training.max_tokens} tokens each; {training.num_substeps} optimizer step(s)"
    )
    for dataset in config.datasets:
        if dataset.env is not None:
            lines.append(
                f"episodes       {dataset.name}: {dataset.env.name}, up to {dataset.env.max_turns} "
                f"turns and {dataset.env.episode_tokens(training.max_tokens)} tokens after the "
                "prompt"
            )
    cut = micro_batch_line(training, student_size, dtype, student)
    lines.append(f"micro-batches  {cut}")
    split = processes if sharded else 1
    # PEFT keeps adapters in float32 under a half-precision base (its autocast_adapter_dtype)
    trained_bytes = BYTES["float32"] if student.lora_rank else BYTES[dtype]
    adapter = trainable * trained_bytes if student.lora_rank else 0
    weights = (student_size.parameters * BYTES[dtype] + adapter) / split
    gradients = trainable * trained_bytes / split
    # a half-precision weight trained whole: float32 moments and a float32 master copy
    master = not student.lora_rank and BYTES[dtype] < BYTES["float32"]
    optimizer = (ADAM_STATES + master) * trainable * BYTES["float32"] / split
    total = weights + gradients + optimizer
    lines.append(
        "memory/device  (weights, gradients, optimizer state; activations and KV cache not "
        "included)"
    )
    adam = "AdamW with float32 master weights" if master else "AdamW"
    lines.append(
        f"  student      {total / GB:.2f} GB: weights {weights / GB:.2f} + gradients "
        f"{gradients / GB:.2f} + {adam} {optimizer / GB:.2f}"
    )
    for key, (teacher, _, _) in teachers.items():
        size = teacher_sizes[key]
        if size is None:
            continue
        bytes_ = (
            size.parameters
            * BYTES[dtype_name(teacher.dtype, teacher.device)]
            / (processes if teacher_sharded else 1)
        )
        total += bytes_
        lines.append(f"  teacher      {bytes_ / GB:.2f} GB: weights")
    if sampler == "vllm":
        share = student.sampler_options.get("gpu_memory_utilization", GPU_MEMORY_UTILIZATION)
        lines.append(f"  vllm         {share:g} of a GPU's memory (its weights and KV cache)")
    lines.append(
        f"  total        {total / GB:.2f} GB" + (" + vLLM's share" if sampler == "vllm" else "")
    )
    return "\n".join(lines)
