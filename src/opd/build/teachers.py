"""A run's teachers built from its config, one per dataset (shared where datasets share one)."""

from __future__ import annotations

from opd.build.student import Student
from opd.config import Config
from opd.distributed import announce
from opd.policy.parallel import parallel_modes
from opd.teachers.base import TeacherRequest
from opd.teachers.config import STUDENT, TeacherConfig
from opd.teachers.panel import TeacherPanel


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
    return TeacherPanel(
        teachers,
        [f"datasets[{i}].teacher" if d.teacher else "teacher" for i, d in enumerate(config.datasets)],
        student.tokenizer,
        student.renderer,
        pad_id,
        request=request,
        batch_size=config.training.teacher_batch_size,
        chunk_size=config.training.logprob_chunk_size,
        token_budget=token_budget,
        packing=config.training.packing,
        student_base=(config.student.model, student.policy.model) if shared else None,
    )


def run_teachers(config: Config) -> list[TeacherConfig]:
    """Each dataset's teacher, ``model: student`` read as the student's own checkpoint."""
    student = config.student
    return [
        config.teacher_for(d).of_student(student.model, student.tokenizer, student.trust_remote_code)
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
    own = [t for _, t in config.teachers() if t.backend == "local" and t.model in (STUDENT, student.model)]
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
