"""A copy of the student for sampling rollouts: in a cheaper dtype, with LoRA adapters merged.

Decoding reads every weight once per new token, so its time follows the bytes read: a
bfloat16 copy of a float32 student decodes faster wherever bfloat16 matmuls are fast, as
vLLM-based trainers do. A LoRA student's adapters are merged into the copy's weights
(:func:`opd.policy.lora.sampler_weights`). The recorded log-probs are the copy's, so the
importance ratio of the policy loss (and ``kl_sample_train``) sees any gap.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from opd.logprobs import unwrap_peft
from opd.policy.lora import mergeable_lora_layers, sampler_weights


class SamplingCopy:
    """``model`` with its floating-point parameters cast to ``dtype`` and LoRA merged, for rollouts
    only.

    The weights are cast (and merged) in by :meth:`rollout` and freed when it ends, so the copy
    costs no memory outside sampling (the update's peak never holds it); a LoRA student's
    frozen base, cast again at every rollout, costs a cast instead of its size for the whole
    run. Buffers (rotary frequencies, ...) are copied as they are, as ``from_pretrained``
    keeps them. The copy is the plain Hugging Face model, without PEFT's wrapper.
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype):
        self.dtype = dtype
        self.source = model
        base = unwrap_peft(model)
        placeholders = {
            id(p): nn.Parameter(self._empty(p), False)
            for p in base.parameters()
            if p.is_floating_point()
        }
        # deepcopy takes a memo entry as the copy of that object: the parameters are not
        # copied, and ties between them are kept.
        self.model = copy.deepcopy(base, memo=dict(placeholders)).eval()
        self.merged = mergeable_lora_layers(base)
        for name in self.merged:
            parent_name, _, child_name = name.rpartition(".")
            parent = self.model.get_submodule(parent_name)
            setattr(parent, child_name, getattr(parent, child_name).base_layer)
        self._held = dict(self.model.named_parameters())

    def _empty(self, parameter: torch.Tensor) -> torch.Tensor:
        return torch.empty(0, dtype=self.dtype, device=parameter.device)

    @contextmanager
    def rollout(
        self, weights: Iterable[tuple[str, torch.Tensor]] | None = None
    ) -> Iterator[nn.Module]:
        """The copy holding the student's current weights (or the given sampler ``weights``),
        freed again on exit."""
        filled = []
        if weights is None:
            weights = sampler_weights(self.source, self.dtype, self.merged)
        with torch.no_grad():
            for name, weight in weights:
                held = self._held[name]
                held.data = weight.to(self.dtype)  # shared, not copied, when already in dtype
                filled.append(held)
        try:
            yield self.model
        finally:
            for held in filled:
                held.data = self._empty(held)
