"""The student being trained, behind one object: its model, where it lives and how it is called.

Everything that touches the student's weights goes through :class:`Policy`: the update's
forward (:meth:`Policy.forward_rows`, one call of :attr:`Policy.module`, so a DDP or FSDP
wrapper sees the whole computation, lm head included), the weights a sampler needs
(:meth:`Policy.sampler_weights`), saving and loading. :meth:`Policy.parallelize` is the one
place where parallelism is applied.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from torch import nn

from opd.logprobs import (
    LogitTransform,
    RowsFunction,
    ScoredRows,
    logit_transform_for,
    scatter_rows,
    selected_token_logprobs,
    unwrap_peft,
)
from opd.models import load_causal_lm, module_device
from opd.packing import packing_problem, use_packed_attention
from opd.policy.config import StudentConfig
from opd.policy.lora import apply_lora, sampler_weights
from opd.policy.parallel import ParallelMode, parallel_mode
from opd.policy.weights import load_weights


class Policy:
    """The student: a Hugging Face causal LM, LoRA-wrapped when ``lora_rank > 0``.

    ``vocab_size`` is the tokenizer's: distributions are normalised over its ids only, so an
    embedding padded beyond it changes nothing. ``version`` counts the optimizer steps applied
    since the run began; a rollout engine records the version its weights came from.
    """

    def __init__(self, model: nn.Module, vocab_size: int):
        self.model = model
        self.scored_rows = ScoredRows(model)
        self.module: nn.Module = self.scored_rows
        self.vocab_size = vocab_size
        self.device = module_device(model)
        self.version = 0
        self.parallel: ParallelMode = parallel_mode("none")
        """How :meth:`parallelize` shares the student among processes
        (:mod:`opd.policy.parallel`)."""

    @classmethod
    def load(cls, student: StudentConfig, vocab_size: int) -> Policy:
        """Load ``student.model`` on its device in its dtype, with LoRA adapters when asked for."""
        base = load_causal_lm(
            student.model,
            "student.model",
            dtype=student.dtype,
            device=student.device,
            trust_remote_code=student.trust_remote_code,
        )
        return cls(apply_lora(base, student), vocab_size)

    def parallelize(self) -> None:
        """Apply :attr:`parallel` to :attr:`module`: the one place parallelism is applied. The
        optimizer must be built afterwards: a sharding mode replaces the parameters."""
        self.module = self.parallel.wrap(self.module, self.base_model, self.device)

    def use_packing(self, enabled: bool) -> str | None:
        """Run the student's forwards packed (:mod:`opd.packing`) when ``enabled`` and the model
        can; returns why it cannot (its forwards then stay padded)."""
        problem = packing_problem(self.base_model) if enabled else None
        self.scored_rows.packed = enabled and problem is None
        use_packed_attention(self.base_model, self.scored_rows.packed)
        return problem

    @property
    def packed(self) -> bool:
        """Whether the student's forwards run packed rows."""
        return self.scored_rows.packed

    @property
    def sharded(self) -> bool:
        """Whether each process holds only a shard of the weights (FSDP)."""
        return self.parallel.shards

    @contextmanager
    def gathered(self) -> Iterator[None]:
        """Every weight whole on every process while inside (FSDP all-gathers; a no-op otherwise).

        A collective: every process must enter it together.
        """
        with self.parallel.gathered(self.module):
            yield

    def reshard(self) -> None:
        """Free every gathered weight (a no-op unless sharded). FSDP keeps the root's weights
        whole after a forward, expecting the backward; after a forward with no backward (the
        current log-probs) the next forward and backward would otherwise start from that state."""
        self.parallel.reshard(self.module)

    def gradient_sync(self, enabled: bool):
        """A context in which backward does (or, accumulating micro-batches, does not yet) reduce
        gradients across processes."""
        return nullcontext() if enabled else self.parallel.gradient_sync_off(self.module)

    @property
    def base_model(self) -> nn.Module:
        """The Hugging Face model inside PEFT's wrapper (adapter layers included)."""
        return unwrap_peft(self.model)

    @property
    def has_adapters(self) -> bool:
        """Whether the student trains LoRA adapters (a sampler of it has them to merge)."""
        return self.base_model is not self.model

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the weights."""
        return self.base_model.dtype

    def generation_stop_ids(self) -> list[int]:
        """The end-of-sequence ids the checkpoint's generation config names (none when it names
        none)."""
        config = self.base_model.generation_config
        eos = config.eos_token_id if config is not None else None
        return [i for i in (eos if isinstance(eos, list) else [eos]) if i is not None]

    def trainable_parameters(self) -> list[nn.Parameter]:
        """What the optimizer updates: the adapters under LoRA, every weight otherwise."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def train(self, mode: bool = True) -> None:
        """Training mode (dropout on) or evaluation mode."""
        self.model.train(mode)

    def logit_transform(self, temperature: float = 1.0) -> LogitTransform:
        """How the model's own forward scales its logits, then ``temperature``."""
        return logit_transform_for(self.model, temperature)

    def forward_rows(
        self,
        input_ids_BT: torch.Tensor,
        attention_mask_BT: torch.Tensor,
        score_mask_BT: torch.Tensor,
        rows_function: RowsFunction,
        *,
        autocast_dtype: torch.dtype | None = None,
    ):
        """``(rows_function(hidden_ND, token_ids_N, lm_head), selected_BT)`` over the scored
        positions.

        The body runs under ``torch.autocast(autocast_dtype)`` when given; the hidden states come
        back in the head's dtype (:func:`opd.logprobs.scored_hidden_states`).
        """
        return self.module(
            input_ids_BT.to(self.device),
            attention_mask_BT.to(self.device),
            score_mask_BT.to(self.device),
            rows_function,
            autocast_dtype,
        )

    def sequence_logprobs(
        self,
        input_ids_BT: torch.Tensor,
        attention_mask_BT: torch.Tensor,
        score_mask_BT: torch.Tensor,
        *,
        temperature: float = 1.0,
        chunk_size: int = 1024,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probs and entropies (B, T) at the scored positions, zero elsewhere."""
        transform = self.logit_transform(temperature)

        def logprobs(hidden_ND, token_ids_N, head):
            return selected_token_logprobs(
                hidden_ND,
                head,
                token_ids_N,
                chunk_size=chunk_size,
                transform=transform,
                vocab_size=self.vocab_size,
            )

        (logprobs_N, entropy_N), selected_BT = self.forward_rows(
            input_ids_BT, attention_mask_BT, score_mask_BT, logprobs
        )
        return scatter_rows(logprobs_N, selected_BT), scatter_rows(entropy_N, selected_BT)

    def sampler_weights(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """Every weight a sampler needs, by its plain Hugging Face name, LoRA merged, in ``dtype``.

        Sharded weights must be read inside :meth:`gathered`.
        """
        return sampler_weights(self.model, dtype)

    def streamed_sampler_weights(
        self, dtype: torch.dtype, bucket_bytes: int
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """:meth:`sampler_weights`, gathered a bucket at a time when sharded.

        Under FSDP the weights are gathered a bucket of sharded units at a time
        (:meth:`opd.policy.parallel.fsdp.FSDP.streamed_weights`), so at most one bucket is ever
        whole; unsharded students give their weights as they are. A collective where sharded.
        """
        names = {id(parameter): name for name, parameter in self.base_model.named_parameters()}

        def weights(only: set[str] | None) -> Iterator[tuple[str, torch.Tensor]]:
            return sampler_weights(self.model, dtype, only=only)

        yield from self.parallel.streamed_weights(
            self.module, weights, names, bucket_bytes, dtype.itemsize
        )

    def save(self, directory: Path) -> None:
        """The weights as safetensors: a PEFT adapter under LoRA, a full Hugging Face model
        otherwise."""
        self.model.save_pretrained(directory, safe_serialization=True)

    def save_adapter(self, directory: Path) -> None:
        """The LoRA adapter as PEFT saves it, its shards gathered first under FSDP (a collective:
        every process calls it together, each writing its own ``directory``)."""
        state = self.parallel.whole_trainable_state(self.model)
        if state is None:
            self.save(directory)
            return
        self.model.save_pretrained(directory, safe_serialization=True, state_dict=state)

    def load_weights(self, model_dir: Path) -> None:
        """Load a saved adapter or full model (:func:`opd.policy.weights.load_weights`)."""
        load_weights(self.model, model_dir)
