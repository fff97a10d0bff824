"""A copy of the student for sampling rollouts: in a cheaper dtype, with LoRA adapters merged.

Decoding reads every weight once per new token, so its time follows the bytes read: a
bfloat16 copy of a float32 student decodes up to twice as fast (1.5-1.9x for SmolLM2-135M on
a CPU with bfloat16 instructions), as vLLM-based trainers do. A LoRA student's adapters are
merged into the copy's weights (``W + scale * B @ A``), as vLLM-based trainers merge them
before syncing weights: each decode step then runs one matmul per layer instead of three, and
none of PEFT's per-layer Python. The recorded log-probs are the copy's, so the importance
ratio of the policy loss (and ``kl_sample_train``) sees any gap.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from opd.logprobs import unwrap_peft


def _adapter_delta(layer: nn.Module) -> torch.Tensor:
    """What a PEFT LoRA layer's active adapters add to its base weight."""
    return sum(layer.get_delta_weight(name) for name in layer.active_adapters)


def _is_plain_lora_layer(module: nn.Module) -> bool:
    """A PEFT LoRA layer whose active adapters are a plain ``scale * B @ A`` on its base weight."""
    base_weight = getattr(getattr(module, "base_layer", None), "weight", None)
    if not hasattr(module, "get_delta_weight") or not isinstance(base_weight, nn.Parameter):
        return False
    adapters = list(module.active_adapters)
    special = [getattr(module, flag, {}).get(name) for flag in ("use_dora", "lora_bias") for name in adapters]
    return bool(adapters) and not any(special) and not module.merged_adapters and not module.disable_adapters


def mergeable_lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The PEFT LoRA layers (by module name) whose adapters fold into their base weight.

    A layer is left as it is when its base weight is shared with another module (a LoRA'd
    embedding tied to the lm head: merging would change the head too), when an adapter is
    already merged or disabled, or when it uses DoRA or a LoRA bias (not a plain weight sum).
    """
    use_count = Counter(id(parameter) for _, parameter in model.named_parameters(remove_duplicate=False))
    layers = {}
    for name, module in model.named_modules():
        if _is_plain_lora_layer(module) and use_count[id(module.base_layer.weight)] == 1:
            with torch.no_grad():
                if _adapter_delta(module).shape == module.base_layer.weight.shape:
                    layers[name] = module
    return layers


class SamplingCopy:
    """``model`` with its floating-point parameters cast to ``dtype`` and LoRA merged, for rollouts only.

    The weights are cast (and merged) in by :meth:`rollout` and freed when it ends, so the copy
    costs no memory outside sampling (the update's peak never holds it); a LoRA student's
    frozen base, cast again at every rollout, costs a cast (about 0.2 s for 135M weights on a
    CPU) instead of its size for the whole run. Buffers (rotary frequencies, ...) are copied as
    they are, as ``from_pretrained`` keeps them. The copy is the plain Hugging Face model,
    without PEFT's wrapper.
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype):
        self.dtype = dtype
        base = unwrap_peft(model)
        placeholders = {
            id(p): nn.Parameter(self._empty(p), False) for p in base.parameters() if p.is_floating_point()
        }
        # deepcopy takes a memo entry as the copy of that object: the parameters are not
        # copied, and ties between them are kept.
        self.model = copy.deepcopy(base, memo=dict(placeholders)).eval()
        merged = mergeable_lora_layers(base)
        for name in merged:
            parent_name, _, child_name = name.rpartition(".")
            parent = self.model.get_submodule(parent_name)
            setattr(parent, child_name, getattr(parent, child_name).base_layer)
        merged_weights = {id(placeholders[id(layer.base_layer.weight)]): layer for layer in merged.values()}
        trained_of = {id(placeholders[id(p)]): p for p in base.parameters() if id(p) in placeholders}
        self._casts: list[tuple[nn.Parameter, nn.Parameter]] = []
        self._merges: list[tuple[nn.Parameter, nn.Module]] = []
        for copied in self.model.parameters():
            if id(copied) in merged_weights:
                self._merges.append((copied, merged_weights[id(copied)]))
            elif id(copied) in trained_of:
                self._casts.append((copied, trained_of[id(copied)]))

    def _empty(self, parameter: torch.Tensor) -> torch.Tensor:
        return torch.empty(0, dtype=self.dtype, device=parameter.device)

    @contextmanager
    def rollout(self) -> Iterator[nn.Module]:
        """The copy holding the student's current weights, freed again on exit."""
        with torch.no_grad():
            for copied, trained in self._casts:
                copied.data = trained.detach().to(self.dtype)  # shared, not copied, when already in dtype
            for copied, layer in self._merges:
                merged = _adapter_delta(layer)
                merged += layer.base_layer.weight
                copied.data = merged.to(self.dtype)
        try:
            yield self.model
        finally:
            for copied, _ in self._casts + self._merges:
                copied.data = self._empty(copied)
