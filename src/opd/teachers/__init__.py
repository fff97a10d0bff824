"""Teacher backends: score the student's sampled tokens (:mod:`opd.teachers.base` is the I/O
type)."""

from opd.teachers.base import Teacher, TeacherInput, TeacherRequest, TeacherScores
from opd.teachers.config import TeacherConfig

__all__ = [
    "LocalTeacher",
    "RemoteTeacher",
    "Teacher",
    "TeacherConfig",
    "TeacherInput",
    "TeacherRequest",
    "TeacherScores",
]


def __getattr__(name: str) -> object:
    """The backends on first use: a local teacher imports transformers, which a config check does
    not need."""
    if name == "LocalTeacher":
        from opd.teachers.local import LocalTeacher

        return LocalTeacher
    if name == "RemoteTeacher":
        from opd.teachers.remote import RemoteTeacher

        return RemoteTeacher
    raise AttributeError(f"module 'opd.teachers' has no attribute {name!r}")
