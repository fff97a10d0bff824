"""Student rollouts behind a small interface: HF generate today, a faster engine later."""

from opd.sampling.base import Completion, Sampler

__all__ = ["Completion", "Sampler"]
