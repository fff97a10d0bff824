"""Rollout engines behind one contract (:mod:`opd.sampling.base`), found by ``student.sampler`` in
:mod:`opd.sampling.engines`: Hugging Face ``generate``, an in-process vLLM, vLLM servers."""

from opd.sampling.base import Completion, RolloutEngine, Sampler, SamplingParams

__all__ = ["Completion", "RolloutEngine", "Sampler", "SamplingParams"]
