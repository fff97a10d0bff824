"""Building the rollout engine ``student.sampler`` names."""

from __future__ import annotations

from collections.abc import Callable

from opd.data.render import ChatRenderer
from opd.models import DTYPES
from opd.policy.config import StudentConfig
from opd.policy.policy import Policy
from opd.sampling.base import RolloutEngine
from opd.sampling.hf_generate import HFEngine


def _hf_engine(
    student: StudentConfig, policy: Policy, tokenizer, renderer: ChatRenderer, seed: int
) -> HFEngine:
    return HFEngine(
        policy,
        tokenizer,
        stop_token_ids=renderer.stop_token_ids,
        stop_strings=renderer.stop_strings,
        sampling_dtype=DTYPES.get(student.sampling_dtype),
    )


def _vllm_engine(student: StudentConfig, policy: Policy, tokenizer, renderer: ChatRenderer, seed: int):
    from opd.sampling.vllm_engine import VLLMEngine

    return VLLMEngine(
        student,
        policy,
        tokenizer,
        stop_token_ids=renderer.stop_token_ids,
        stop_strings=renderer.stop_strings,
        seed=seed,
    )


def _vllm_server_engine(student: StudentConfig, policy: Policy, tokenizer, renderer: ChatRenderer, seed: int):
    from opd.sampling.vllm_server import VLLMServerEngine

    return VLLMServerEngine(
        student,
        policy,
        tokenizer,
        stop_token_ids=renderer.stop_token_ids,
        stop_strings=renderer.stop_strings,
    )


ENGINES: dict[str, Callable[..., RolloutEngine]] = {
    "hf": _hf_engine,
    "vllm": _vllm_engine,
    "vllm_server": _vllm_server_engine,
}
"""Each value of ``student.sampler`` and how its engine is built."""


def build_rollout_engine(
    student: StudentConfig, policy: Policy, tokenizer, renderer: ChatRenderer, *, seed: int = 0
) -> RolloutEngine:
    """The engine that samples ``policy``'s rollouts, stopping where ``renderer`` says a turn ends."""
    return ENGINES[student.sampler](student, policy, tokenizer, renderer, seed)
