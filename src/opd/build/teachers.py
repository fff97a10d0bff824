"""A run's teachers built from its config, one per dataset (shared where datasets share one)."""

from __future__ import annotations

from opd.build.student import Student
from opd.config import Config
from opd.distributed import announce
from opd.teachers.base import TeacherRequest
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
    local = {t.model for t in (config.teacher_for(d) for d in config.datasets) if t.backend == "local"}
    for model in sorted(local):
        announce(f"loading the teacher {model} ...")
    return TeacherPanel(
        [config.teacher_for(d) for d in config.datasets],
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
