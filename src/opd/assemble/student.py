"""A run's student built from its config: tokenizer, model (LoRA-wrapped when asked), renderer;
shared by training, ``opd eval`` and ``opd export``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from opd.config import Config, ConfigError
from opd.data.render import ChatRenderer
from opd.distributed import announce
from opd.models import load_tokenizer
from opd.policy.policy import Policy
from opd.sampling.hf_generate import HFGenerateSampler


@dataclass
class Student:
    """The student's tokenizer, its model (:class:`opd.policy.Policy`) and how its prompts are
    rendered."""

    tokenizer: object
    policy: Policy
    renderer: ChatRenderer

    def sampler_for(self, model) -> HFGenerateSampler:
        """A sampler of ``model`` (the student, or a teacher) that stops where the student's turns
        end."""
        return HFGenerateSampler(
            model,
            self.tokenizer,
            stop_token_ids=self.renderer.stop_token_ids,
            stop_strings=self.renderer.stop_strings,
        )


def load_student(config: Config) -> Student:
    """Tokenizer first (the objective's options are checked against its vocabulary), then the model,
    its LoRA adapters initialised from the run's seed."""
    torch.manual_seed(config.seed)
    student = config.student
    announce(f"loading the student {student.model} ...")
    tokenizer = load_tokenizer(
        student.tokenizer or student.model,
        "student.model",
        trust_remote_code=student.trust_remote_code,
    )
    training = config.training
    for field in ("objective", "off_policy_objective"):
        objective = getattr(training, field)
        for option, problem in objective.vocabulary_problems(len(tokenizer)) if objective else ():
            raise ConfigError(f"training.{field}.{option}: {problem}")
    policy = Policy.load(student, len(tokenizer))
    renderer = ChatRenderer(
        tokenizer,
        student.chat_template,
        extra_stop_ids=policy.generation_stop_ids(),
        template_kwargs=student.chat_template_kwargs,
    )
    return Student(tokenizer, policy, renderer)
