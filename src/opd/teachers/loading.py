"""Teachers loaded from their config sections, one loader per backend (``TEACHER_BACKENDS``).

A new backend is one loader here (or in its own module) and a registry line; the panel never
reads a backend's fields. What every loader is given besides its section is a
:class:`TeacherLoading`: the student's tokenizer (a teacher sharing the student's token ids has
its vocabulary checked against it) and how a local teacher batches its forwards.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass

from opd.distributed import launched_world
from opd.models import PROBE_TEXTS, check_same_vocabulary, load_causal_lm, load_tokenizer
from opd.teachers.alignment import TeacherFormat
from opd.teachers.base import Teacher
from opd.teachers.config import TeacherConfig
from opd.teachers.local import AdaptersOffTeacher, LocalTeacher
from opd.teachers.remote import RemoteTeacher
from opd.teachers.replicas import check_replicas


@dataclass(frozen=True)
class LocalScoring:
    """How a local teacher batches its no-grad forwards (the run's micro-batching)."""

    pad_id: int
    batch_size: int = 32
    chunk_size: int = 1024
    token_budget: int | None = None
    packing: bool = True


@dataclass(frozen=True)
class TeacherLoading:
    """What loading a teacher needs besides its own section."""

    tokenizer: object
    """The student's tokenizer: the ids a teacher that shares them must read alike."""
    scoring: LocalScoring
    student_base: tuple[str, object] | None = None
    """The student's model path and its LoRA model, whose base (adapters off) scores for a local
    teacher of that path (None: every local teacher is loaded)."""


def load_local(
    teacher_cfg: TeacherConfig,
    where: str,
    loading: TeacherLoading,
    teacher_format: TeacherFormat | None,
) -> Teacher:
    """The model in this process (the student's own base with its adapters off, where the teacher
    is the LoRA student's starting model), scoring over the teacher's vocabulary when it has its
    own tokenizer, else the student's."""
    options = asdict(loading.scoring)
    vocab_size = len(loading.tokenizer)
    base = loading.student_base
    if base is not None and teacher_cfg.model == base[0]:
        return AdaptersOffTeacher(base[1], vocab_size=vocab_size, **options)
    model = load_causal_lm(
        teacher_cfg.model,
        f"{where}.model",
        dtype=teacher_cfg.dtype,
        device=teacher_cfg.device,
        trust_remote_code=teacher_cfg.trust_remote_code,
    )
    if teacher_cfg.cross_tokenizer:
        vocab_size = len(teacher_format.renderer.tokenizer)
    teacher = LocalTeacher(model, vocab_size=vocab_size, **options)
    if teacher.packing_problem and launched_world().is_main:
        warnings.warn(
            f"training.packing: {teacher.packing_problem}; the teacher {teacher_cfg.model} scores "
            "padded",
            stacklevel=2,
        )
    return teacher


def load_remote(
    teacher_cfg: TeacherConfig,
    where: str,
    loading: TeacherLoading,
    teacher_format: TeacherFormat | None,
) -> Teacher:
    """A vLLM or SGLang server (or replicas of one), each replica probed before any work."""
    remote = RemoteTeacher.from_config(teacher_cfg)
    probe_tokenizer = teacher_format.renderer.tokenizer if teacher_format else loading.tokenizer
    probe_ids = probe_tokenizer.encode(" ".join(PROBE_TEXTS), add_special_tokens=False)
    check_replicas(remote, probe_ids, teacher_cfg.replica_probes, where)
    return remote


Loader = Callable[[TeacherConfig, str, TeacherLoading, "TeacherFormat | None"], Teacher]

TEACHER_BACKENDS: dict[str, Loader] = {
    "local": load_local,
    "openai": load_remote,
    "sglang": load_remote,
}
"""``teacher.backend`` -> the loader of its teachers."""


def load_teacher(
    teacher_cfg: TeacherConfig,
    where: str,
    loading: TeacherLoading,
    teacher_format: TeacherFormat | None,
) -> Teacher:
    """The teacher of ``teacher_cfg`` (``where`` names its section in errors), its tokenizer
    checked against the student's first where it reads the student's token ids."""
    tokenizer_name = teacher_cfg.tokenizer or (
        teacher_cfg.model if teacher_cfg.backend == "local" else None
    )
    if tokenizer_name is not None and not teacher_cfg.cross_tokenizer:
        field_name = f"{where}.tokenizer" if teacher_cfg.tokenizer else f"{where}.model"
        teacher_tokenizer = load_tokenizer(
            tokenizer_name, field_name, trust_remote_code=teacher_cfg.trust_remote_code
        )
        check_same_vocabulary(loading.tokenizer, teacher_tokenizer, field_name)
    return TEACHER_BACKENDS[teacher_cfg.backend](teacher_cfg, where, loading, teacher_format)
