"""Sampling with Hugging Face ``generate`` (KV cache), recording sampled-token log-probs.

:class:`HFGenerateSampler` samples from one model; :class:`HFEngine` is the student's rollout
engine built on it, sampling from the student itself or from a :class:`SamplingCopy` of it.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from opd.data.sequences import Completion
from opd.logprobs import unwrap_peft
from opd.models import module_device
from opd.policy.policy import Policy
from opd.sampling.base import SamplingParams, ends_in_stop_string, pad_id_for, row_seeds
from opd.sampling.precision import SamplingCopy
from opd.sampling.seeded import seeded_draw, tempered_scores


def _contiguous_input(_module: torch.nn.Module, args: tuple) -> tuple:
    return (args[0].contiguous(), *args[1:])


@contextmanager
def contiguous_head_input(model):
    """Hand the lm head a contiguous input while ``model`` generates.

    The prefill passes the head only the last position, a strided slice of the hidden states.
    For a weight that does not require grad (a sampling copy, a frozen head under LoRA),
    ``torch.matmul`` then cannot fold that slice into one matrix and multiplies it by a
    batch-expanded copy of the weight: a batch x vocab x hidden copy per rollout, where copying
    the slice costs a few kilobytes.
    """
    head = model.get_output_embeddings()
    handle = None if head is None else head.register_forward_pre_hook(_contiguous_input)
    try:
        yield
    finally:
        if handle is not None:
            handle.remove()


class _SampledLogprobRecorder(LogitsProcessor):
    """Applies the temperature, remembers log-softmax of each step and, unless greedy, draws the
    token.

    At step t+1 ``input_ids`` ends with the token sampled at step t, so that token's
    log-prob is read from the previous step's distribution: only one B x V row is held.
    When drawing, it returns scores that are -inf everywhere but the drawn token, so
    ``generate``'s greedy argmax takes it.
    """

    def __init__(
        self,
        temperature: float,
        vocab_size: int | None,
        *,
        seeds_B: torch.Tensor | None,
    ):
        self.temperature = temperature
        self.vocab_size = vocab_size
        self.seeds_B = seeds_B
        """Each row's seed (:func:`counter_uniform`); None: greedy, nothing is drawn."""
        self.previous_logprobs: torch.Tensor | None = None
        self.recorded: list[torch.Tensor] = []

    def _gather_previous(self, last_tokens: torch.Tensor) -> None:
        if self.previous_logprobs is not None:
            self.recorded.append(
                self.previous_logprobs.gather(-1, last_tokens[:, None]).squeeze(-1)
            )

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self._gather_previous(
            input_ids[:, -1]
        )  # after it, len(recorded) is this decode step's index
        scores = tempered_scores(scores, self.temperature, self.vocab_size)
        self.previous_logprobs = torch.log_softmax(scores, dim=-1)
        if self.seeds_B is None:
            return scores
        tokens_B = seeded_draw(self.previous_logprobs, self.seeds_B, len(self.recorded))
        return torch.full_like(scores, float("-inf")).scatter_(-1, tokens_B[:, None], 0.0)

    def finish(self, sequences: torch.Tensor) -> torch.Tensor:
        """Log-probs of all generated tokens, (B, generated)."""
        self._gather_previous(sequences[:, -1])
        return torch.stack(self.recorded, dim=1)


class HFGenerateSampler:
    """Samples from a causal LM with ``model.generate``; stops at any stop id or stop string.

    The distribution sampled from is exactly ``softmax(logits / temperature)`` over the
    tokenizer's vocabulary (no top-k/top-p, and none of the model's own generation
    defaults), so the recorded log-probs are the behaviour policy's. The recorder draws
    each token (:func:`inverse_cdf_sample`) and ``generate`` runs greedy over its choice.
    """

    def __init__(
        self,
        model,
        tokenizer,
        *,
        stop_token_ids: list[int],
        stop_strings: list[str] | None = None,
        batch_size: int | None = None,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.stop_token_ids = stop_token_ids
        self.stop_strings = stop_strings or []
        self.batch_size = batch_size
        self.pad_id = pad_id_for(tokenizer, stop_token_ids)
        self.device = module_device(model)

    @torch.no_grad()
    def sample(
        self,
        prompts: list[list[int]],
        *,
        temperature: float,
        max_tokens: int,
        greedy: bool = False,
        seed: int | list[int] | None = None,
    ) -> list[Completion]:
        """One completion per prompt; ``seed``: one for the call, one per prompt, or None (drawn
        from torch's global generator). Each row's draws depend on its seed alone."""
        if seed is None:
            seed = torch.randint(0, 2**62, (len(prompts),)).tolist()
        seeds = row_seeds(seed, len(prompts))
        size = self.batch_size or len(prompts)
        completions: list[Completion] = []
        for start in range(0, len(prompts), size):
            rows = slice(start, start + size)
            completions += self._sample_batch(
                prompts[rows], temperature, max_tokens, None if greedy else seeds[rows]
            )
        return completions

    def generation_config(self, max_tokens: int) -> GenerationConfig:
        """What ``generate`` is told: greedy, as the temperature and the draw are the recorder's."""
        return GenerationConfig(
            do_sample=False,
            max_new_tokens=max_tokens,
            eos_token_id=self.stop_token_ids,
            pad_token_id=self.pad_id,
            stop_strings=self.stop_strings or None,
        )

    def _sample_batch(
        self, prompts, temperature, max_tokens, seeds: list[int] | None
    ) -> list[Completion]:
        device = self.device
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            attention_mask[row, width - len(prompt) :] = 1
        recorder = _SampledLogprobRecorder(
            1.0 if seeds is None else temperature,
            len(self.tokenizer),
            seeds_B=None if seeds is None else torch.tensor(seeds, dtype=torch.long, device=device),
        )
        generation_config = self.generation_config(max_tokens)
        # generate() fills every unset field from the model's own generation_config
        # (repetition_penalty, min_new_tokens, ...); hide it so only our settings apply.
        base = unwrap_peft(self.model)
        model_defaults, base.generation_config = base.generation_config, GenerationConfig()
        was_training = self.model.training
        self.model.eval()
        try:
            with contiguous_head_input(self.model):
                sequences = self.model.generate(
                    input_ids=input_ids.to(device),
                    attention_mask=attention_mask.to(device),
                    generation_config=generation_config,
                    logits_processor=LogitsProcessorList([recorder]),
                    tokenizer=self.tokenizer if self.stop_strings else None,
                )
        finally:
            self.model.train(was_training)
            base.generation_config = model_defaults
        generated = sequences[:, width:].cpu()
        logprobs = recorder.finish(sequences).cpu()
        return [
            self._cut(generated[row].tolist(), logprobs[row].tolist())
            for row in range(len(prompts))
        ]

    def _cut(self, token_ids: list[int], logprobs: list[float]) -> Completion:
        """Keep tokens up to and including the first stop token or completed stop string."""
        stops = set(self.stop_token_ids)
        for end, token in enumerate(token_ids, start=1):
            if token in stops or (
                self.stop_strings
                and ends_in_stop_string(self.tokenizer, token_ids[:end], self.stop_strings)
            ):
                return Completion(token_ids[:end], logprobs[:end], finished=True)
        return Completion(token_ids, logprobs, finished=False)


class HFEngine:
    """The student's rollout engine on Hugging Face ``generate``, in the trainer's process.

    It samples from the policy's own model, or from a :class:`SamplingCopy` whose weights are
    read at every rollout: with ``sampling_dtype`` set (and a cast or a LoRA merge to make),
    under FSDP (a process holds only a shard, so the copy holds the gathered weights while it
    samples), or when asked (``copy=True``: a worker collecting ahead of learning samples
    weights published to it, never the ones being updated). :meth:`sync` records the source
    of the next rollout's weights and its version: the policy (in process, read as they are
    then) or any published weights with a ``version`` and ``sampler_weights(dtype)``.
    """

    def __init__(
        self,
        policy: Policy,
        tokenizer,
        *,
        stop_token_ids: list[int],
        stop_strings: list[str] | None = None,
        sampling_dtype: torch.dtype | None = None,
        copy: bool = False,
    ):
        self.policy = policy
        needs_copy = (
            copy
            or policy.sharded
            or (
                sampling_dtype is not None
                and (sampling_dtype != policy.dtype or policy.has_adapters)
            )
        )
        self.copy = (
            SamplingCopy(policy.model, sampling_dtype or policy.dtype) if needs_copy else None
        )
        self.model = self.copy.model if self.copy else policy.model
        self.sampler = HFGenerateSampler(
            self.model, tokenizer, stop_token_ids=stop_token_ids, stop_strings=stop_strings
        )
        self.pad_id = self.sampler.pad_id
        self.source = policy
        self.version = policy.version

    @property
    def dtype(self) -> torch.dtype:
        """The dtype it samples in (weights published to it are taken in this dtype)."""
        return self.copy.dtype if self.copy else self.policy.dtype

    @property
    def serves_evaluation(self) -> bool:
        """Whether evaluation should decode with this engine: under FSDP the student itself is
        sharded, and generating from it would need every process in lock step."""
        return self.policy.sharded

    def sync(self, source) -> None:
        """Take the next rollout's weights from ``source``: the policy, or published weights."""
        if self.copy is None and source is not self.policy:
            raise ValueError(
                "an in-process HFEngine without a copy samples the policy it was built for"
            )
        self.source = source
        self.version = source.version

    @contextmanager
    def _weights(self):
        """The model to sample from, holding the source's weights."""
        if self.copy is None:
            yield self.model
        elif self.source is self.policy:
            with self.policy.gathered(), self.copy.rollout() as model:
                yield model
        else:
            with self.copy.rollout(self.source.sampler_weights(self.copy.dtype)) as model:
                yield model

    def rollout(
        self, prompts: list[list[int]], params: SamplingParams, *, seeds: list[int]
    ) -> list[Completion]:
        """One completion per prompt, each drawn with its own seed."""
        with self._weights():
            completions = self.sampler.sample(
                prompts,
                temperature=params.temperature,
                max_tokens=params.max_tokens,
                greedy=params.greedy,
                seed=seeds,
            )
        return [dataclasses.replace(c, policy_version=self.version) for c in completions]

    def sample(
        self,
        prompts: list[list[int]],
        *,
        temperature: float,
        max_tokens: int,
        greedy: bool = False,
        seed: int | list[int] | None = None,
    ) -> list[Completion]:
        """Decode for evaluation from the synced weights (:class:`opd.sampling.base.Sampler`)."""
        with self._weights():
            return self.sampler.sample(
                prompts, temperature=temperature, max_tokens=max_tokens, greedy=greedy, seed=seed
            )
