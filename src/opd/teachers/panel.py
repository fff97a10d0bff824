"""The run's teachers: one per dataset, loaded once per distinct model or server.

They score the student's rollouts with what the objective needs (log-probs, top-k or hidden
states). A teacher with its own chat template or tokenizer sees each rollout through a
:class:`TeacherFormat`; the others read the batch's own padded tensors.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import torch

from opd.data.render import ChatRenderer
from opd.data.sequences import RolloutBatch, turn_spans
from opd.models import load_tokenizer
from opd.sampling.hf_generate import HFGenerateSampler
from opd.teachers.alignment import TeacherFormat
from opd.teachers.base import Teacher, TeacherInput, TeacherRequest, TeacherScores, rows_by_identity
from opd.teachers.config import TeacherConfig
from opd.teachers.context import PrivilegedContext
from opd.teachers.loading import TeacherLoading, load_teacher
from opd.teachers.mixture import mixed_logprobs, mixed_topk
from opd.teachers.remote import RemoteTeacher
from opd.teachers.writer import TeacherSample, TeacherWriter


@dataclass(frozen=True)
class Reading:
    """One teacher as it reads a dataset's rows: the model or server, the format it reads them in
    (None: the student's tokens as they are) and the privileged context it is shown (None: none)."""

    teacher: Teacher
    format: TeacherFormat | None
    context: PrivilegedContext | None


class TeacherPanel:
    """Every dataset's teacher, how it reads the student's rollouts, and what to ask it for.

    ``teachers[i]`` scores dataset i (``fields[i]`` names it in errors: ``teacher`` or
    ``datasets[i].teacher``); ``request`` is what :meth:`score` asks for unless told otherwise
    (None: the run needs no teacher answer, only :meth:`logprobs` for evaluation).
    """

    def __init__(
        self,
        teachers: list[TeacherConfig],
        fields: list[str],
        renderer: ChatRenderer,
        loading: TeacherLoading,
        *,
        request: TeacherRequest | None,
    ):
        self.loading, self.renderer, self.request = loading, renderer, request
        self.tokenizer, self.pad_id = loading.tokenizer, loading.scoring.pad_id
        self.vocab_size = len(self.tokenizer)
        self._formats: dict[tuple, TeacherFormat | None] = {}
        self._loaded: dict[tuple, Teacher] = {}
        shared: dict[tuple, tuple[tuple[Reading, float], ...]] = {}
        self.readings = []
        """Per dataset, the teachers that score it with their weights (one, weight 1, unless its
        teacher is a mixture): one object shared by the datasets read alike (the same teachers,
        formats and contexts), whose rows are scored together."""
        for teacher_cfg, where in zip(teachers, fields, strict=True):
            mixed = teacher_cfg.mixture is not None
            members = tuple(
                (self._reading(member, f"{where}.mixture[{j}]" if mixed else where), w)
                for j, (member, w) in enumerate(teacher_cfg.members)
            )
            key = tuple((id(r.teacher), id(r.format), r.context, w) for r, w in members)
            self.readings.append(shared.setdefault(key, members))
        self.per_dataset = [members[0][0].teacher for members in self.readings]
        """Each dataset's (first) teacher."""

    def _reading(self, teacher_cfg: TeacherConfig, where: str) -> Reading:
        """The teacher of ``teacher_cfg`` as it reads rows: loaded once per model or server, with
        one format per tokenizer and template."""
        format_key = teacher_cfg.format_key()
        if format_key not in self._formats:
            self._formats[format_key] = self._teacher_format(teacher_cfg)
        teacher_format = self._formats[format_key]
        key = teacher_cfg.load_key()
        if key not in self._loaded:
            self._loaded[key] = load_teacher(teacher_cfg, where, self.loading, teacher_format)
        return Reading(self._loaded[key], teacher_format, teacher_cfg.privileged_context)

    def _teacher_format(self, teacher_cfg: TeacherConfig) -> TeacherFormat | None:
        """How a teacher with its own template or tokenizer sees the rollouts (None: as the
        student)."""
        renderer = teacher_renderer(teacher_cfg, self.renderer)
        if renderer is None:
            return None
        tokenizer = renderer.tokenizer
        return TeacherFormat(
            renderer,
            self.tokenizer,
            self.renderer.stop_token_ids,
            teacher_cfg.cross_tokenizer,
            character_topk=min(teacher_cfg.character_topk, len(tokenizer)),
        )

    def replica_metrics(self) -> dict[str, float]:
        """``teacher/replicas_live``: the replicas in rotation over every remote teacher given
        several (none logged without one)."""
        pools = [
            t.pool for t in self._loaded.values() if isinstance(t, RemoteTeacher) and t.pool.several
        ]
        return {"teacher/replicas_live": float(sum(pool.live for pool in pools))} if pools else {}

    def writers(self) -> list[TeacherWriter]:
        """Each dataset's teacher as the writer of the completions of ``data_source: teacher`` (and
        ``mixed``'s teacher steps): one per distinct teacher, format and context, stopping where
        the teacher's turns end (its own template's, or the student's)."""
        built: dict[tuple, TeacherWriter] = {}
        writers = []
        for members in self.readings:
            reading = members[0][0]  # a mixture writes nothing (opd.config.rules)
            key = (id(reading.teacher), id(reading.format), reading.context)
            if key not in built:
                renderer = reading.format.renderer if reading.format else self.renderer
                built[key] = TeacherWriter(
                    _teacher_sample(reading.teacher, renderer),
                    reading.format,
                    self.tokenizer,
                    self.renderer.stop_token_ids,
                    reading.context,
                )
            writers.append(built[key])
        return writers

    def score(self, batch: RolloutBatch, request: TeacherRequest | None = None) -> TeacherScores:
        """Each row scored by its dataset's teacher (or mixture), with what ``request`` (default:
        the panel's) asks for."""
        request = request or self.request or TeacherRequest()
        inputs = TeacherInput(batch.input_ids_BT, batch.attention_mask_BT, batch.mask_BT.bool())
        groups = rows_by_identity(
            [self.readings[index] for index in batch.dataset_index_B.tolist()]
        )
        members = self.readings[int(batch.dataset_index_B[0])]
        if len(groups) == 1 and len(members) == 1 and members[0][0].format is None:
            return members[0][0].teacher.score(
                inputs, request
            )  # one teacher reading the student's tokens
        scores = TeacherScores.zeros(*batch.mask_BT.shape, request)
        for rows in groups:
            members = self.readings[int(batch.dataset_index_B[rows[0]])]
            if len(members) == 1:
                self._put(scores, rows, batch, inputs, members[0][0], request)
                continue
            answers = []
            for reading, _ in members:
                answers.append(TeacherScores.zeros(*batch.mask_BT.shape, request))
                self._put(answers[-1], rows, batch, inputs, reading, request)
            self._put_mixed(scores, rows, batch, answers, [w for _, w in members], request)
        return scores

    def _put(
        self,
        scores: TeacherScores,
        rows: list[int],
        batch: RolloutBatch,
        inputs: TeacherInput,
        reading: Reading,
        request: TeacherRequest,
    ) -> None:
        """One teacher's answer for ``rows``, written into ``scores``."""
        if reading.format is not None:
            self._put_formatted(scores, rows, batch, reading, request)
            return
        answer = reading.teacher.score(inputs.select(torch.tensor(rows)), request)
        width = answer.logprobs_BT.shape[1]
        for i, row in enumerate(rows):
            scores.logprobs_BT[row, :width] = answer.logprobs_BT[i]
            scores.put(row, slice(0, width), answer, i, slice(0, width), reading)

    def _put_mixed(
        self,
        scores: TeacherScores,
        rows: list[int],
        batch: RolloutBatch,
        answers: list[TeacherScores],
        weights: list[float],
        request: TeacherRequest,
    ) -> None:
        """The mixture of the teachers' ``answers`` at the scored positions of ``rows``; each
        teacher's log-probs kept beside it (``member_logprobs_MBT``) for its own KL."""
        selected = torch.zeros_like(batch.mask_BT, dtype=torch.bool)
        selected[rows] = batch.mask_BT[rows].bool()
        weights_M = torch.tensor(weights)
        logprobs_MN = torch.stack([a.logprobs_BT[selected] for a in answers])
        scores.logprobs_BT[selected] = mixed_logprobs(logprobs_MN, weights_M)
        if request.topk:
            ids, logprobs = mixed_topk(
                torch.stack([a.topk_ids_BTK[selected] for a in answers]),
                torch.stack([a.topk_logprobs_BTK[selected] for a in answers]),
                weights_M,
                request.topk,
                self.vocab_size,
            )
            scores.topk_ids_BTK[selected], scores.topk_logprobs_BTK[selected] = ids, logprobs
        if scores.member_logprobs_MBT is None or scores.member_logprobs_MBT.shape[0] < len(answers):
            kept = torch.full((len(answers), *scores.logprobs_BT.shape), float("nan"))
            if scores.member_logprobs_MBT is not None:
                kept[: scores.member_logprobs_MBT.shape[0]] = scores.member_logprobs_MBT
            scores.member_logprobs_MBT = kept
        for number, answer in enumerate(answers):
            scores.member_logprobs_MBT[number][selected] = answer.logprobs_BT[selected]
        for answer, weight in zip(
            answers, weights, strict=True
        ):  # full distributions: each its share
            for share in answer.shares or []:
                scores.shares = (scores.shares or []) + [
                    replace(share, weight_BT=share.weight_BT * weight)
                ]

    def _put_formatted(
        self,
        scores: TeacherScores,
        rows: list[int],
        batch: RolloutBatch,
        reading: Reading,
        request: TeacherRequest,
    ) -> None:
        """Score the rows in the teacher's own format, then map its answer back onto the student's
        tokens, turn by turn (an episode's environment replies are the teacher's to render, not to
        score)."""
        teacher, teacher_format, context = reading.teacher, reading.format, reading.context
        sequences = batch.sequences
        trajectories = batch.trajectories or [None] * len(sequences)
        records = [batch.prompt_records[r] for r in rows]
        built = [
            teacher_format.build(
                context.messages(record) if context else record.messages,
                sequences[r][batch.prompt_lengths[r] :],
                trajectories[r],
            )
            for r, record in zip(rows, records, strict=True)
        ]
        teacher_request = request
        if teacher_format.cross_tokenizer and teacher_format.character_topk:
            # its likely tokens split each of its tokens' log-prob over characters
            teacher_request = replace(request, topk=teacher_format.character_topk, temperature=1.0)
        answer = teacher.score(
            TeacherInput.from_sequences(
                [b.token_ids for b in built], [b.score_mask for b in built], self.pad_id
            ),
            teacher_request,
        )
        for i, row in enumerate(rows):
            prompt_length = batch.prompt_lengths[row]
            spans = turn_spans(trajectories[row], len(sequences[row]) - prompt_length)
            for (start, end), piece in zip(spans, built[i].turns, strict=True):
                student_span = slice(prompt_length + start, prompt_length + end)
                teacher_span = slice(piece.start, piece.start + piece.length)
                taught = answer.logprobs_BT[i, teacher_span]
                if teacher_format.cross_tokenizer:
                    student = batch.sampled_logprobs_BT[row, student_span].tolist()
                    topk = None
                    if answer.topk_ids_BTK is not None:
                        topk = [
                            list(zip(ids, logprobs, strict=True))
                            for ids, logprobs in zip(
                                answer.topk_ids_BTK[i, teacher_span].tolist(),
                                answer.topk_logprobs_BTK[i, teacher_span].tolist(),
                                strict=True,
                            )
                        ]
                    logprobs = taught.tolist()
                    view = teacher_format.student_view(built[i], piece, logprobs, student, topk)
                    if request.topk:
                        turn_ids = sequences[row][student_span]
                        rows_K = teacher_format.student_next_tokens(
                            built[i], piece, logprobs, topk, turn_ids, view, request.topk
                        )
                        scores.topk_ids_BTK[row, student_span] = torch.tensor(
                            [ids for ids, _ in rows_K]
                        )
                        scores.topk_logprobs_BTK[row, student_span] = torch.tensor(
                            [lps for _, lps in rows_K]
                        )
                    taught = torch.tensor(view)
                scores.logprobs_BT[row, student_span] = taught
            if teacher_format.cross_tokenizer:
                # its top-k is in the student's tokens above, and it sends no hidden states
                continue
            scored = batch.mask_BT[row].bool()
            teacher_scored = torch.zeros(answer.logprobs_BT.shape[1], dtype=torch.bool)
            teacher_scored[: len(built[i].token_ids)] = torch.tensor(built[i].score_mask)
            teacher_scored[0] = False
            scores.put(row, scored, answer, i, teacher_scored, reading)

    def logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        """The teachers' log-probs of a batch's sampled tokens (templates and tokenizers
        applied)."""
        return self.score(batch, TeacherRequest()).logprobs_BT


def teacher_renderer(teacher_cfg: TeacherConfig, student: ChatRenderer) -> ChatRenderer | None:
    """How a teacher renders conversations when it does not read the student's tokens as they are
    (its own template or tokenizer, or a privileged context to insert); None when it does. A
    teacher without a template of its own renders as the student does, the student's template
    variables included."""
    if (
        not teacher_cfg.chat_template
        and not teacher_cfg.cross_tokenizer
        and teacher_cfg.context is None
    ):
        return None
    name = teacher_cfg.tokenizer or teacher_cfg.model
    own = teacher_cfg.cross_tokenizer or teacher_cfg.chat_template == "tokenizer"
    tokenizer = (
        load_tokenizer(name, "teacher.tokenizer") if own else copy.deepcopy(student.tokenizer)
    )
    template = (
        None if teacher_cfg.chat_template in (None, "tokenizer") else teacher_cfg.chat_template
    )
    variables = (
        teacher_cfg.chat_template_kwargs if teacher_cfg.chat_template else student.template_kwargs
    )
    return ChatRenderer(tokenizer, template, template_kwargs=variables)


def _teacher_sample(teacher: Teacher, renderer: ChatRenderer) -> TeacherSample:
    """How ``teacher`` samples in its own ids, stopping where ``renderer``'s turns end: on its
    server, or with the sampler that samples the student."""
    stops, strings = renderer.stop_token_ids, renderer.stop_strings
    if isinstance(teacher, RemoteTeacher):

        def sample_remote(prompts, temperature, max_tokens, seeds):
            return teacher.sample(
                prompts,
                temperature=temperature,
                max_tokens=max_tokens,
                seeds=seeds,
                stop_token_ids=stops,
                stop_strings=strings,
            )

        return sample_remote
    sampler = HFGenerateSampler(
        teacher.model, renderer.tokenizer, stop_token_ids=stops, stop_strings=strings
    )

    def sample_local(prompts, temperature, max_tokens, seeds):
        return sampler.sample(prompts, temperature=temperature, max_tokens=max_tokens, seed=seeds)

    return sample_local
