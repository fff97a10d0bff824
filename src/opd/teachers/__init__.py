"""Teacher backends: score the student's sampled tokens."""

from opd.teachers.base import Teacher
from opd.teachers.local import LocalTeacher, TeacherScores
from opd.teachers.remote import RemoteTeacher

__all__ = ["LocalTeacher", "RemoteTeacher", "Teacher", "TeacherScores"]
