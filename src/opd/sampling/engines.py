"""The rollout engines by name (``student.sampler``): each one's settings and how it is built, and
the ``student`` section that holds every engine's settings beside the model's.

A new engine is a module (the engine, and its settings class extending
:class:`opd.sampling.base.SamplerSettings` with its own fields and their checks) plus its line in
:data:`ENGINES` and its settings class among :class:`StudentSection`'s bases.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from opd.policy.config import StudentConfig
from opd.sampling.base import RolloutEngine, SamplerSettings
from opd.sampling.vllm_server_settings import VLLMServerSettings
from opd.sampling.vllm_settings import VLLMSettings

if TYPE_CHECKING:
    from opd.data.render import ChatRenderer
    from opd.policy.policy import Policy
    from opd.sampling.hf_generate import HFEngine


def _hf_engine(
    student: SamplerSettings, policy: Policy, tokenizer, renderer: ChatRenderer, seed: int
) -> HFEngine:
    from opd.models import DTYPES
    from opd.sampling.hf_generate import HFEngine

    return HFEngine(
        policy,
        tokenizer,
        stop_token_ids=renderer.stop_token_ids,
        stop_strings=renderer.stop_strings,
        sampling_dtype=DTYPES.get(student.sampling_dtype),
    )


def _vllm_engine(
    student: VLLMSettings, policy: Policy, tokenizer, renderer: ChatRenderer, seed: int
):
    from opd.sampling.vllm_engine import VLLMEngine

    return VLLMEngine(
        student,
        policy,
        tokenizer,
        stop_token_ids=renderer.stop_token_ids,
        stop_strings=renderer.stop_strings,
        seed=seed,
    )


def _vllm_server_engine(
    student: VLLMServerSettings, policy: Policy, tokenizer, renderer: ChatRenderer, seed: int
):
    from opd.sampling.vllm_server import VLLMServerEngine

    return VLLMServerEngine(
        student,
        policy,
        tokenizer,
        stop_token_ids=renderer.stop_token_ids,
        stop_strings=renderer.stop_strings,
    )


@dataclass(frozen=True)
class Engine:
    """A rollout engine as ``student.sampler`` names it."""

    settings: type[SamplerSettings]
    """The settings it reads: its own fields, checked by its ``sampler_problems()``."""
    build: Callable[..., RolloutEngine]
    """``build(student, policy, tokenizer, renderer, seed)``: the engine for a run."""


ENGINES: dict[str, Engine] = {
    "hf": Engine(SamplerSettings, _hf_engine),
    "vllm": Engine(VLLMSettings, _vllm_engine),
    "vllm_server": Engine(VLLMServerSettings, _vllm_server_engine),
}
"""Each value of ``student.sampler``: its settings and how its engine is built."""


@dataclass
class StudentSection(VLLMServerSettings, VLLMSettings):
    """The config's ``student`` section: the model (:class:`opd.policy.StudentConfig`) and every
    engine's settings in one flat mapping; an engine's settings apply only when it is the
    sampler."""

    sampler: Literal[tuple(ENGINES)] = "hf"  # type: ignore[valid-type]  # the registered names

    def problems(self) -> Iterator[tuple[str, str]]:
        """``(field, problem)``: the model's settings, another engine's settings set (they would be
        ignored), then the chosen engine's own checks."""
        yield from StudentConfig.problems(self)
        engine = ENGINES[self.sampler].settings
        for setting in dataclasses.fields(StudentSection):
            if setting.name in _names(engine) or getattr(self, setting.name) == _default(setting):
                continue
            users = [name for name, e in ENGINES.items() if setting.name in _names(e.settings)]
            yield (
                setting.name,
                (
                    f"applies to sampler: {' or '.join(users)} only (student.sampler is "
                    f"{self.sampler!r})"
                ),
            )
            return
        yield from self.sampler_problems()

    def sampler_problems(self) -> Iterator[tuple[str, str]]:
        """The chosen engine's checks of its settings."""
        return ENGINES[self.sampler].settings.sampler_problems(self)

    def plan_line(self) -> str:
        """The chosen engine's line in the dry-run plan."""
        return ENGINES[self.sampler].settings.plan_line(self)


def _names(settings: type) -> set[str]:
    return {f.name for f in dataclasses.fields(settings)}


def _default(setting: dataclasses.Field) -> object:
    if setting.default_factory is not dataclasses.MISSING:
        return setting.default_factory()
    return setting.default


def build_rollout_engine(
    student: StudentSection, policy: Policy, tokenizer, renderer: ChatRenderer, *, seed: int = 0
) -> RolloutEngine:
    """The engine that samples ``policy``'s rollouts, stopping where ``renderer`` says a turn
    ends."""
    return ENGINES[student.sampler].build(student, policy, tokenizer, renderer, seed)
