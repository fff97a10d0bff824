"""The run's teachers: one per dataset, loaded once per distinct model or server.

They score the student's rollouts (log-probs, top-k or hidden states, as the objective
needs) and, for off-policy data sources, write completions themselves. A teacher with its
own chat template or tokenizer sees each rollout through a :class:`TeacherFormat`.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from opd.config import Config, TeacherConfig, TrainingConfig
from opd.data.render import ChatRenderer
from opd.logprobs import logit_transform_for
from opd.models import check_same_vocabulary, load_causal_lm, load_tokenizer
from opd.sampling.base import Completion
from opd.sampling.hf_generate import HFGenerateSampler
from opd.teachers.alignment import TeacherFormat
from opd.teachers.base import Teacher
from opd.teachers.local import LocalTeacher
from opd.teachers.remote import RemoteTeacher
from opd.trainer.rollouts import RolloutBatch
from opd.trainer.update import TeacherTargets


class TeacherPanel:
    """Every dataset's teacher, how it reads the student's rollouts, and a sampler for local ones."""

    def __init__(self, config: Config, tokenizer, renderer: ChatRenderer, pad_id: int):
        self.config, self.tokenizer, self.renderer, self.pad_id = config, tokenizer, renderer, pad_id
        self.vocab_size = len(tokenizer)
        self.formats: list[TeacherFormat | None] = []
        self.per_dataset = self._load_all()
        self.samplers = {
            id(teacher): HFGenerateSampler(
                teacher.model,
                tokenizer,
                stop_token_ids=renderer.stop_token_ids,
                stop_strings=renderer.stop_strings,
            )
            for teacher in self.per_dataset
            if isinstance(teacher, LocalTeacher)
        }

    def _load_all(self) -> list[Teacher]:
        loaded: dict[tuple, Teacher] = {}
        formats: dict[tuple, TeacherFormat | None] = {}
        per_dataset = []
        for index, dataset in enumerate(self.config.datasets):
            teacher_cfg: TeacherConfig = self.config.teacher_for(dataset)
            where = f"datasets[{index}].teacher" if dataset.teacher else "teacher"
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
        if not teacher_cfg.chat_template and not teacher_cfg.cross_tokenizer:
            return None
        name = teacher_cfg.tokenizer or teacher_cfg.model
        own = teacher_cfg.cross_tokenizer or teacher_cfg.chat_template == "tokenizer"
        tokenizer = load_tokenizer(name, "teacher.tokenizer") if own else copy.deepcopy(self.tokenizer)
        template = None if teacher_cfg.chat_template in (None, "tokenizer") else teacher_cfg.chat_template
        renderer = ChatRenderer(tokenizer, template)
        return TeacherFormat(
            renderer, self.tokenizer, self.renderer.stop_token_ids, teacher_cfg.cross_tokenizer
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
        return LocalTeacher(
            model,
            vocab_size=vocab_size,
            pad_id=self.pad_id,
            batch_size=self.config.training.teacher_batch_size,
            chunk_size=self.config.training.logprob_chunk_size,
        )

    def rows_by_teacher(self, dataset_indices: list[int]) -> dict[int, list[int]]:
        groups: dict[int, list[int]] = {}
        for row, dataset_index in enumerate(dataset_indices):
            groups.setdefault(id(self.per_dataset[dataset_index]), []).append(row)
        return groups

    def score(self, batch: RolloutBatch, training: TrainingConfig | None = None) -> TeacherTargets:
        """Each row scored by its dataset's teacher, with what the objective needs (top-k, hidden).

        ``training`` overrides the run's objective settings (to evaluate another divergence).
        """
        training = training or self.config.training
        topk = training.topk if training.objective == "topk_forward_kl" else 0
        hidden = training.objective == "jsd"
        shape = batch.sampled_logprobs_BT.shape
        targets = TeacherTargets(torch.zeros(shape))
        if topk:
            targets.topk_ids_BTK = torch.zeros(*shape, topk, dtype=torch.long)
            targets.topk_logprobs_BTK = torch.zeros(*shape, topk)
        sequences = batch.sequences
        masks = [row.bool().tolist() for row in batch.mask_BT]
        for rows in self.rows_by_teacher(batch.dataset_index_B.tolist()).values():
            dataset_index = int(batch.dataset_index_B[rows[0]])
            teacher, teacher_format = self.per_dataset[dataset_index], self.formats[dataset_index]
            if teacher_format is not None:
                built = [
                    teacher_format.build(batch.messages[r], sequences[r][batch.prompt_lengths[r] :])
                    for r in rows
                ]
                sent, sent_masks = [b.token_ids for b in built], [b.score_mask for b in built]
            else:
                sent, sent_masks = [sequences[r] for r in rows], [masks[r] for r in rows]
            scores = teacher.score(
                sent, sent_masks, topk=topk, hidden=hidden, temperature=training.temperature
            )
            for i, row in enumerate(rows):
                values = scores.logprobs[i]
                if teacher_format is not None:
                    start, end = batch.prompt_lengths[row], len(sequences[row])
                    student = batch.sampled_logprobs_BT[row, start:end].tolist()
                    answer = values[built[i].completion_start :].tolist()
                    targets.logprobs_BT[row, start:end] = torch.tensor(
                        teacher_format.student_view(built[i], answer, student)
                    )
                else:
                    targets.logprobs_BT[row, : values.shape[0]] = values
                scored = batch.mask_BT[row].bool()
                if topk:
                    targets.topk_ids_BTK[row][scored] = scores.topk_ids[i]
                    targets.topk_logprobs_BTK[row][scored] = scores.topk_logprobs[i]
                if hidden:
                    if targets.hidden_BTD is None:
                        first = scores.hidden[i]  # kept in the teacher's dtype, as its head runs
                        targets.hidden_BTD = first.new_zeros(*shape, first.shape[-1])
                        targets.head, targets.transform = (
                            teacher.lm_head,
                            logit_transform_for(teacher.model, training.temperature),
                        )
                    targets.hidden_BTD[row][scored.to(targets.hidden_BTD.device)] = scores.hidden[i]
        return targets

    def logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        """The teachers' log-probs of a batch's sampled tokens (templates and tokenizers applied)."""
        token_only = dataclasses.replace(self.config.training, objective="sampled_reverse_kl")
        return self.score(batch, token_only).logprobs_BT

    def sample(
        self, prompts: list[list[int]], dataset_indices: list[int], *, temperature: float, max_tokens: int
    ) -> list[Completion]:
        """Each prompt's completion written by its dataset's teacher (local teachers only)."""
        completions: list[Completion] = [None] * len(prompts)
        for rows in self.rows_by_teacher(dataset_indices).values():
            sampler = self.samplers[id(self.per_dataset[dataset_indices[rows[0]]])]
            sampled = sampler.sample(
                [prompts[r] for r in rows], temperature=temperature, max_tokens=max_tokens
            )
            for row, completion in zip(rows, sampled, strict=True):
                completions[row] = completion
        return completions
