"""Teacher backends: score the student's sampled tokens."""

from opd.teachers.local import LocalTeacher

__all__ = ["LocalTeacher"]
