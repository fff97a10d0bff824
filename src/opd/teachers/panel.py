"""The run's teachers: one per dataset, loaded once per distinct model or server.

They score the student's rollouts with what the objective needs (log-probs, top-k or hidden
states). A teacher with its own chat template or tokenizer sees each rollout through a
:class:`TeacherFormat`; the others read the batch's own padded tensors.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import replace

import torch

from opd.data.render import ChatRenderer
from opd.data.sequences import RolloutBatch, turn_spans
from opd.distributed import launched_world
from opd.models import check_same_vocabulary, load_causal_lm, load_tokenizer
from opd.sampling.hf_generate import HFGenerateSampler
from opd.teachers.alignment import TeacherFormat
from opd.teachers.base import Teacher, TeacherInput, TeacherRequest, TeacherScores, rows_by_identity
from opd.teachers.config import TeacherConfig
from opd.teachers.local import LocalTeacher
from opd.teachers.remote import RemoteTeacher
from opd.teachers.writer import TeacherSample, TeacherWriter


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
        tokenizer,
        renderer: ChatRenderer,
        pad_id: int,
        *,
        request: TeacherRequest | None,
        batch_size: int = 32,
        chunk_size: int = 1024,
        token_budget: int | None = None,
        packing: bool = True,
    ):
        self.tokenizer, self.renderer, self.pad_id, self.request = tokenizer, renderer, pad_id, request
        self.batch_size, self.chunk_size = batch_size, chunk_size
        self.token_budget, self.packing = token_budget, packing
        self.vocab_size = len(tokenizer)
        self.formats: list[TeacherFormat | None] = []
        self.contexts = [teacher.privileged_context for teacher in teachers]
        """Each dataset's teacher's privileged context (None: it reads the student's conversation)."""
        self.per_dataset = self._load_all(teachers, fields)
        readings: dict[tuple, tuple] = {}
        self.readings = [
            readings.setdefault((id(t), id(f), c), (t, f, c))
            for t, f, c in zip(self.per_dataset, self.formats, self.contexts, strict=True)
        ]
        """Per dataset, the one object shared by the datasets read alike (the same teacher, format
        and context), whose rows are scored together."""

    def _load_all(self, teachers: list[TeacherConfig], fields: list[str]) -> list[Teacher]:
        loaded: dict[tuple, Teacher] = {}
        formats: dict[tuple, TeacherFormat | None] = {}
        per_dataset = []
        for teacher_cfg, where in zip(teachers, fields, strict=True):
            key = (
                teacher_cfg.backend,
                teacher_cfg.base_url,
                teacher_cfg.model,
                teacher_cfg.dtype,
                teacher_cfg.device,
            )
            format_key = (
                teacher_cfg.tokenizer or teacher_cfg.model,
                teacher_cfg.chat_template,
                teacher_cfg.cross_tokenizer,
                teacher_cfg.character_topk,
                teacher_cfg.context is not None,  # a context needs the conversation re-rendered
            )
            if format_key not in formats:
                formats[format_key] = self._teacher_format(teacher_cfg)
            teacher_format = formats[format_key]
            if key not in loaded:
                loaded[key] = self._load_teacher(teacher_cfg, where, teacher_format)
            per_dataset.append(loaded[key])
            self.formats.append(teacher_format)
        return per_dataset

    def _teacher_format(self, teacher_cfg: TeacherConfig) -> TeacherFormat | None:
        """How a teacher with its own template or tokenizer sees the rollouts (None: as the student)."""
        if not teacher_cfg.chat_template and not teacher_cfg.cross_tokenizer and teacher_cfg.context is None:
            return None
        name = teacher_cfg.tokenizer or teacher_cfg.model
        own = teacher_cfg.cross_tokenizer or teacher_cfg.chat_template == "tokenizer"
        tokenizer = load_tokenizer(name, "teacher.tokenizer") if own else copy.deepcopy(self.tokenizer)
        template = None if teacher_cfg.chat_template in (None, "tokenizer") else teacher_cfg.chat_template
        renderer = ChatRenderer(tokenizer, template, template_kwargs=teacher_cfg.chat_template_kwargs)
        return TeacherFormat(
            renderer,
            self.tokenizer,
            self.renderer.stop_token_ids,
            teacher_cfg.cross_tokenizer,
            character_topk=min(teacher_cfg.character_topk, len(tokenizer)),
        )

    def _load_teacher(
        self, teacher_cfg: TeacherConfig, where: str, teacher_format: TeacherFormat | None
    ) -> Teacher:
        tokenizer_name = teacher_cfg.tokenizer or (
            teacher_cfg.model if teacher_cfg.backend == "local" else None
        )
        if tokenizer_name is not None and not teacher_cfg.cross_tokenizer:
            field_name = f"{where}.tokenizer" if teacher_cfg.tokenizer else f"{where}.model"
            teacher_tokenizer = load_tokenizer(
                tokenizer_name, field_name, trust_remote_code=teacher_cfg.trust_remote_code
            )
            check_same_vocabulary(self.tokenizer, teacher_tokenizer, field_name)
        if teacher_cfg.backend != "local":
            return RemoteTeacher(
                backend=teacher_cfg.backend,
                base_url=teacher_cfg.base_url,
                model=teacher_cfg.model,
                api_key_env=teacher_cfg.api_key_env,
                timeout_s=teacher_cfg.timeout_s,
                max_retries=teacher_cfg.max_retries,
                max_concurrency=teacher_cfg.max_concurrency,
                request_batch_size=teacher_cfg.request_batch_size,
            )
        model = load_causal_lm(
            teacher_cfg.model,
            f"{where}.model",
            dtype=teacher_cfg.dtype,
            device=teacher_cfg.device,
            trust_remote_code=teacher_cfg.trust_remote_code,
        )
        vocab_size = self.vocab_size
        if teacher_cfg.cross_tokenizer:
            vocab_size = len(teacher_format.renderer.tokenizer)
        teacher = LocalTeacher(
            model,
            vocab_size=vocab_size,
            pad_id=self.pad_id,
            batch_size=self.batch_size,
            chunk_size=self.chunk_size,
            token_budget=self.token_budget,
            packing=self.packing,
        )
        if teacher.packing_problem and launched_world().is_main:
            warnings.warn(
                f"training.packing: {teacher.packing_problem}; the teacher {teacher_cfg.model} scores padded",
                stacklevel=2,
            )
        return teacher

    def writers(self) -> list[TeacherWriter]:
        """Each dataset's teacher as the writer of the completions of ``data_source: teacher`` (and
        ``mixed``'s teacher steps): one per distinct teacher and format, stopping where the
        teacher's turns end (its own template's, or the student's)."""
        built: dict[tuple[int, int], TeacherWriter] = {}
        writers = []
        for teacher, teacher_format in zip(self.per_dataset, self.formats, strict=True):
            key = (id(teacher), id(teacher_format))
            if key not in built:
                renderer = teacher_format.renderer if teacher_format else self.renderer
                built[key] = TeacherWriter(
                    _teacher_sample(teacher, renderer),
                    teacher_format,
                    self.tokenizer,
                    self.renderer.stop_token_ids,
                )
            writers.append(built[key])
        return writers

    def score(self, batch: RolloutBatch, request: TeacherRequest | None = None) -> TeacherScores:
        """Each row scored by its dataset's teacher, with what ``request`` (default: the panel's) asks for."""
        request = request or self.request or TeacherRequest()
        inputs = TeacherInput(batch.input_ids_BT, batch.attention_mask_BT, batch.mask_BT.bool())
        groups = rows_by_identity([self.readings[index] for index in batch.dataset_index_B.tolist()])
        first = self.formats[int(batch.dataset_index_B[0])]
        if len(groups) == 1 and first is None:  # one teacher reading the student's tokens: its answer as is
            return self.per_dataset[int(batch.dataset_index_B[0])].score(inputs, request)
        scores = TeacherScores.zeros(*batch.mask_BT.shape, request)
        for rows in groups:
            dataset_index = int(batch.dataset_index_B[rows[0]])
            teacher, teacher_format = self.per_dataset[dataset_index], self.formats[dataset_index]
            if teacher_format is None:
                answer = teacher.score(inputs.select(torch.tensor(rows)), request)
                width = answer.logprobs_BT.shape[1]
                for i, row in enumerate(rows):
                    scores.logprobs_BT[row, :width] = answer.logprobs_BT[i]
                    scores.put(row, slice(0, width), answer, i, slice(0, width))
            else:
                self._put_formatted(scores, rows, batch, teacher, teacher_format, request)
        return scores

    def _put_formatted(
        self,
        scores: TeacherScores,
        rows: list[int],
        batch: RolloutBatch,
        teacher: Teacher,
        teacher_format: TeacherFormat,
        request: TeacherRequest,
    ) -> None:
        """Score the rows in the teacher's own format, then map its answer back onto the student's
        tokens, turn by turn (an episode's environment replies are the teacher's to render, not to score)."""
        sequences = batch.sequences
        trajectories = batch.trajectories or [None] * len(sequences)
        context = self.contexts[int(batch.dataset_index_B[rows[0]])]
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
                        scores.topk_ids_BTK[row, student_span] = torch.tensor([ids for ids, _ in rows_K])
                        scores.topk_logprobs_BTK[row, student_span] = torch.tensor([lps for _, lps in rows_K])
                    taught = torch.tensor(view)
                scores.logprobs_BT[row, student_span] = taught
            if teacher_format.cross_tokenizer:
                continue  # its top-k is in the student's tokens above, and it sends no hidden states
            scored = batch.mask_BT[row].bool()
            teacher_scored = torch.zeros(answer.logprobs_BT.shape[1], dtype=torch.bool)
            teacher_scored[: len(built[i].token_ids)] = torch.tensor(built[i].score_mask)
            teacher_scored[0] = False
            scores.put(row, scored, answer, i, teacher_scored)

    def logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        """The teachers' log-probs of a batch's sampled tokens (templates and tokenizers applied)."""
        return self.score(batch, TeacherRequest()).logprobs_BT


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
    sampler = HFGenerateSampler(teacher.model, renderer.tokenizer, stop_token_ids=stops, stop_strings=strings)

    def sample_local(prompts, temperature, max_tokens, seeds):
        return sampler.sample(prompts, temperature=temperature, max_tokens=max_tokens, seed=seeds)

    return sample_local
