"""A run's teachers built from its config, one per dataset (shared where datasets share one)."""

from __future__ import annotations

from opd.assemble.student import Student
from opd.config import Config, ConfigError
from opd.data.render import ChatRenderer
from opd.data.sources import load_prompts
from opd.data.tables import TableOptions
from opd.distributed import announce
from opd.errors import DataError, ModelLoadError
from opd.models import load_tokenizer
from opd.policy.parallel import parallel_modes
from opd.teachers.base import TeacherRequest
from opd.teachers.config import STUDENT, TeacherConfig
from opd.teachers.loading import LocalScoring, TeacherLoading
from opd.teachers.panel import TeacherPanel, teacher_renderer


def load_teachers(
    config: Config,
    student: Student,
    pad_id: int,
    request: TeacherRequest | None,
    *,
    token_budget: int | None = None,
    parallel: str = "none",
) -> TeacherPanel:
    """Every dataset's teacher, asked for ``request`` by default (token log-probs when None); a
    local one's forwards hold at most ``token_budget`` tokens, packed when ``training.packing``;
    ``teacher.model: student`` is the LoRA student with its adapters off where that is safe
    (:func:`teacher_is_the_students_base`), else a frozen copy."""
    teachers = run_teachers(config)
    shared = teacher_is_the_students_base(config, parallel)
    members = [member for t in teachers for member, _ in t.members]
    local = {t.model for t in members if t.backend == "local"}
    for model in sorted(local):
        if shared and model == config.student.model:
            announce(f"the teacher is the student {model} with its adapters off (no second copy)")
        else:
            announce(f"loading the teacher {model} ...")
    scoring = LocalScoring(
        pad_id,
        batch_size=config.training.teacher_batch_size,
        chunk_size=config.training.logprob_chunk_size,
        token_budget=token_budget,
        packing=config.training.packing,
    )
    loading = TeacherLoading(
        student.tokenizer,
        scoring,
        student_base=(config.student.model, student.policy.model) if shared else None,
    )
    return TeacherPanel(
        teachers,
        [
            f"datasets[{i}].teacher" if d.teacher else "teacher"
            for i, d in enumerate(config.datasets)
        ],
        student.renderer,
        loading,
        request=request,
    )


def run_teachers(config: Config) -> list[TeacherConfig]:
    """Each dataset's teacher, ``model: student`` read as the student's own checkpoint."""
    student = config.student
    return [
        config.teacher_for(d).of_student(
            student.model, student.tokenizer, student.trust_remote_code
        )
        for d in config.datasets
    ]


def teacher_is_the_students_base(config: Config, parallel: str) -> bool:
    """Whether ``teacher.model: student`` scores with the LoRA student's own model, its adapters
    off (no second copy of the weights), rather than a frozen copy.

    Only where that model is the starting weights and nothing else runs it while the teacher
    scores: a LoRA student from ``student.model`` (no ``load_checkpoint_path``), weights not
    sharded, collection synchronous, the teacher reading its log-probs or top-k (not its lm head
    after the forward), writing no completions, in the student's dtype and device.
    """
    student, training = config.student, config.training
    own = [
        t
        for _, t in config.teachers()
        if t.backend == "local" and t.model in (STUDENT, student.model)
    ]
    return bool(
        own
        and student.lora_rank
        and config.load_checkpoint_path is None
        and not parallel_modes()[parallel].shards
        and training.max_staleness == 0
        and training.data_source == "student"
        and training.objective.teacher_signal != "distribution"
        and all(t.dtype == student.dtype and t.device == student.device for t in own)
        and not any(t.cross_tokenizer for t in own)
    )


def teacher_views(config: Config) -> list[str]:
    """The first prompt of each dataset as the student reads it, and as each of its teachers does
    (their template, template variables such as thinking mode, and privileged context): what
    ``--dry-run`` shows, so a teacher reading something else than meant is seen before a step.
    Where the tokenizer or the prompts cannot be read here, a line says why instead."""
    student = config.student
    try:
        tokenizer = load_tokenizer(
            student.tokenizer or student.model,
            "student.model",
            trust_remote_code=student.trust_remote_code,
        )
        variables = student.chat_template_kwargs
        renderer = ChatRenderer(tokenizer, student.chat_template, template_kwargs=variables)
    except (ModelLoadError, ConfigError, OSError, ValueError) as error:
        return [f"prompts        not shown: {error}"]
    lines = []
    for dataset, teacher in zip(config.datasets, run_teachers(config), strict=True):
        try:
            table = TableOptions(dataset.split, dataset.subset, dataset.fields)
            prompt = load_prompts(
                dataset.source,
                seed=config.seed,
                count=1,
                task_config=dataset.task_config,
                table=table,
            )[0]
            seen = renderer.render_text(prompt.messages)
        except (DataError, ConfigError, OSError, ValueError, IndexError) as error:
            lines.append(f"prompt         {dataset.name}: not shown: {error}")
            continue
        lines.append(f"prompt         {dataset.name}, its first prompt, as the student reads it:")
        lines += _indented(seen)
        for number, (member, _) in enumerate(teacher.members):
            name = "teacher" if teacher.mixture is None else f"teacher mixture[{number}]"
            try:
                view = teacher_renderer(member, renderer)
                messages = (
                    member.privileged_context.messages(prompt)
                    if member.context
                    else prompt.messages
                )
                text = seen if view is None else view.render_text(messages)
            except (ModelLoadError, ConfigError, OSError, ValueError) as error:
                lines.append(f"{name:<14} not shown: {error}")
                continue
            if text == seen:
                lines.append(f"{name:<14} reads it as the student does")
            else:
                lines += [f"{name:<14} reads it as:", *_indented(text)]
    return lines


def _indented(text: str) -> list[str]:
    """A rendered prompt, each line indented (an ending newline shown as an empty line)."""
    return [f"  | {line}" for line in text.split("\n")]
