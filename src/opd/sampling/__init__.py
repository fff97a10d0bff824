"""Rollout engines behind one contract (:mod:`opd.sampling.base`): Hugging Face ``generate`` today."""

from opd.sampling.base import Completion, RolloutEngine, Sampler, SamplingParams

__all__ = ["Completion", "RolloutEngine", "Sampler", "SamplingParams"]
