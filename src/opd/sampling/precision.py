"""A copy of the student in a cheaper dtype, for sampling rollouts.

Decoding reads every weight once per new token, so its time follows the bytes read: a
bfloat16 copy of a float32 student decodes up to twice as fast (1.5-1.9x for SmolLM2-135M on
a CPU with bfloat16 instructions), as vLLM-based trainers do. The recorded log-probs are the
copy's, so the importance ratio of the policy loss (and ``kl_sample_train``) sees the gap.
"""

from __future__ import annotations

import copy

import torch
from torch import nn


class SamplingCopy:
    """``model`` with its floating-point parameters cast to ``dtype``, kept in step by :meth:`refresh`.

    Buffers (rotary frequencies, ...) are copied as they are, as ``from_pretrained`` keeps them.
    Between rollouts :meth:`release` frees the copies of the trainable weights (they change
    at every update anyway), so the update's peak memory holds only the frozen ones.
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype):
        self.dtype = dtype
        cast = {
            id(p): nn.Parameter(p.detach().to(dtype, copy=True), requires_grad=False)
            for p in model.parameters()
            if p.is_floating_point()
        }
        # deepcopy takes a memo entry as the copy of that object: each parameter is cast
        # once, without a full-precision duplicate of the model ever existing.
        self.model = copy.deepcopy(model, memo=dict(cast)).eval()
        self._pairs = [(trained, cast[id(trained)]) for trained in model.parameters() if id(trained) in cast]

    @torch.no_grad()
    def refresh(self, *, trainable_only: bool = True) -> None:
        """Cast the student's current weights in: the trainable ones after an update, all of
        them after weights were loaded from a checkpoint."""
        for trained, copied in self._pairs:
            if trained.requires_grad or not trainable_only:
                copied.data = trained.detach().to(self.dtype, copy=True)

    def release(self) -> None:
        """Free the trainable weights' copies until the next :meth:`refresh`."""
        for trained, copied in self._pairs:
            if trained.requires_grad:
                copied.data = torch.empty(0, dtype=self.dtype, device=copied.device)
