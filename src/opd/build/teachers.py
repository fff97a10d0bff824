"""A run's teachers built from its config, one per dataset (shared where datasets share one)."""

from __future__ import annotations

from opd.build.student import Student
from opd.config import Config
from opd.distributed import announce
from opd.teachers.base import TeacherRequest
from opd.teachers.config import TeacherConfig
from opd.teachers.panel import TeacherPanel


def load_teachers(
    config: Config,
    student: Student,
    pad_id: int,
    request: TeacherRequest | None,
    *,
    token_budget: int | None = None,
) -> TeacherPanel:
    """Every dataset's teacher, asked for ``request`` by default (token log-probs when None); a
    local one's forwards hold at most ``token_budget`` tokens, packed when ``training.packing``."""
    teachers = run_teachers(config)
    local = {t.model for t in teachers if t.backend == "local"}
    for model in sorted(local):
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
    )


def run_teachers(config: Config) -> list[TeacherConfig]:
    """Each dataset's teacher, ``model: student`` read as the student's own checkpoint."""
    student = config.student
    return [
        config.teacher_for(d).of_student(student.model, student.tokenizer, student.trust_remote_code)
        for d in config.datasets
    ]
