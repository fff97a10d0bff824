"""Continuous batching for ``opd serve``'s sampling: one decode loop, on its own thread, that every
sampling request's rows join as they arrive and leave as they finish.

Clients send a request a row (vLLM's per-request seed asks them to), so eight clients are eight
one-row requests at a time. Sampled as separate batches they decode side by side, each step of
each paying a whole forward; here a newcomer's prompt is prefilled on its own, its keys and
values are left-padded to the running batch's length and stacked under it, and from the next
step every row decodes in one forward. Each row keeps its own settings (temperature, stops,
``max_tokens``) and draws from its own seed at its own step, so its tokens do not depend on the
rows it shares the batch with.

The loop takes the model for one forward at a time (the server's lock, served in arrival order),
so a scoring request waits at most one decode step or one prefill. A model whose cache is not
the plain growing kind (a sliding window, a model's own layers) cannot be left-padded safely:
its newcomers wait until the running batch ends and start the next one together.
"""

from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import DynamicLayer

from opd.data.sequences import Completion
from opd.models import module_device
from opd.sampling.base import ends_in_stop_string
from opd.sampling.seeded import seeded_draw, tempered_scores


@dataclass(frozen=True)
class RowSettings:
    """How one request's rows are sampled."""

    temperature: float
    """0: greedy (the log-probs recorded at temperature 1)."""
    max_tokens: int
    stop_token_ids: frozenset[int]
    stop_strings: tuple[str, ...]


@dataclass
class SampleJob:
    """One request's rows to sample, and what they became."""

    settings: RowSettings
    prompts: list[list[int]]
    seeds: list[int]
    completions: list[Completion | None] = field(default_factory=list)
    unfinished: int = 0
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.completions = [None] * len(self.prompts)
        self.unfinished = len(self.prompts)


@dataclass
class _Row:
    job: SampleJob
    index: int
    """The row's place among its job's prompts."""
    length: int
    """Real tokens in the model's view: the prompt and every token sampled (the last one is fed at
    the next step)."""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


class ContinuousBatcher:
    """The decode loop behind :meth:`ScoringModel.sample` (started at the first request)."""

    def __init__(self, model, tokenizer, lock, pad_id: int):
        self.model = model
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        self.lock = lock
        """The server's model lock: held for one forward at a time."""
        self.pad_id = pad_id
        self.device = module_device(model)
        parameters = inspect.signature(model.forward).parameters
        self.keeps_logits = "logits_to_keep" in parameters
        self.cache_field = "cache" if "cache" in parameters else "past_key_values"
        """What the model calls its KV cache (transformers renamed ``past_key_values`` in 5.2x)."""
        self.arrived: list[SampleJob] = []
        self.wake = threading.Condition()
        self.thread: threading.Thread | None = None
        self.closing = False
        self.rows: list[_Row] = []
        self.cache = None
        self.mask_BL: torch.Tensor | None = None
        self.next_B: torch.Tensor | None = None
        """Each row's last sampled token, not yet in the cache."""

    def submit(self, job: SampleJob) -> None:
        """Queue ``job``'s rows for the loop; ``job.done`` is set when all are sampled or failed."""
        with self.wake:
            if self.closing:
                job.error = RuntimeError("the model is closed: no more sampling requests")
                job.done.set()
                return
            self.arrived.append(job)
            if self.thread is None:
                self.thread = threading.Thread(target=self._loop, name="opd-decode", daemon=True)
                self.thread.start()
            self.wake.notify()

    def close(self) -> None:
        """End the decode loop once the rows it has are sampled; later requests fail at once.
        Without it the loop's thread waits for work as long as the process lives, holding the
        model (a server stopping, or a program done with its :class:`ScoringModel`)."""
        with self.wake:
            self.closing = True
            self.wake.notify()
            thread = self.thread
        if thread is not None:
            thread.join()

    def _loop(self) -> None:
        while True:
            with self.wake:
                self.wake.wait_for(lambda: self.arrived or self.rows or self.closing)
                if self.closing and not self.arrived and not self.rows:
                    return
                joining = []
                if self.arrived and (not self.rows or self._mergeable()):
                    joining, self.arrived = self.arrived, []
            try:
                with self.lock, torch.no_grad():
                    if joining:
                        self._join(joining)
                    else:
                        self._step()
            except BaseException as error:  # every request in the batch hears it; the loop goes on
                self._fail([*joining, *(row.job for row in self.rows)], error)
            self._finish_rows()

    def _fail(self, jobs: list[SampleJob], error: BaseException) -> None:
        for job in jobs:
            if not job.done.is_set():
                job.error = error
                job.done.set()
        self.rows, self.cache, self.mask_BL, self.next_B = [], None, None, None

    def _mergeable(self) -> bool:
        layers = getattr(self.cache, "layers", None)
        return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)

    def _forward(self, ids_BT, mask_BL, positions_BT, cache):
        keep = {"logits_to_keep": 1} if self.keeps_logits else {}
        output = self.model(
            input_ids=ids_BT.to(self.device),
            attention_mask=mask_BL.to(self.device),
            position_ids=positions_BT.to(self.device),
            use_cache=True,
            **{self.cache_field: cache},
            **keep,
        )
        return output.logits[:, -1], getattr(output, self.cache_field)

    def _join(self, jobs: list[SampleJob]) -> None:
        """Prefill the newcomers' prompts (left-padded), draw their first tokens, and stack their
        cache under the running batch's."""
        rows = [
            _Row(job, index, len(prompt))
            for job in jobs
            for index, prompt in enumerate(job.prompts)
        ]
        width = max(row.length for row in rows)
        ids_BT = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask_BT = torch.zeros_like(ids_BT)
        for b, row in enumerate(rows):
            ids_BT[b, width - row.length :] = torch.tensor(row.job.prompts[row.index])
            mask_BT[b, width - row.length :] = 1
        positions_BT = (mask_BT.cumsum(-1) - 1).clamp(min=0)
        logits_BV, cache = self._forward(ids_BT, mask_BT, positions_BT, None)
        next_B = self._draw(rows, logits_BV)
        if not self.rows:
            self.rows, self.cache, self.mask_BL, self.next_B = rows, cache, mask_BT, next_B
            return
        length = max(self.mask_BL.shape[1], width)
        for old, new in zip(self.cache.layers, cache.layers, strict=True):
            old.keys = torch.cat([_left_pad(old.keys, length), _left_pad(new.keys, length)])
            old.values = torch.cat([_left_pad(old.values, length), _left_pad(new.values, length)])
        self.mask_BL = torch.cat([_left_pad(self.mask_BL, length), _left_pad(mask_BT, length)])
        self.next_B = torch.cat([self.next_B, next_B])
        self.rows += rows

    def _step(self) -> None:
        """One decode step of every running row."""
        self.mask_BL = torch.cat([self.mask_BL, torch.ones_like(self.mask_BL[:, :1])], dim=1)
        positions_B1 = torch.tensor([[row.length - 1] for row in self.rows])
        logits_BV, self.cache = self._forward(
            self.next_B[:, None], self.mask_BL, positions_B1, self.cache
        )
        self.next_B = self._draw(self.rows, logits_BV)

    def _draw(self, rows: list[_Row], logits_BV: torch.Tensor) -> torch.Tensor:
        """Each row's next token from ``softmax(logits / temperature)`` (argmax at 0), drawn from
        its seed at its step, and its log-prob, as opd's own sampler draws them."""
        temperatures = [row.job.settings.temperature or 1.0 for row in rows]
        temperature_B1 = torch.tensor(temperatures, device=logits_BV.device)[:, None]
        scores_BV = tempered_scores(logits_BV, temperature_B1, self.vocab_size)
        logprobs_BV = torch.log_softmax(scores_BV, dim=-1)
        seeds_B = torch.tensor([row.job.seeds[row.index] for row in rows], device=scores_BV.device)
        drawn_B = seeded_draw(logprobs_BV, seeds_B, [len(row.tokens) for row in rows])
        greedy_B = torch.tensor([row.job.settings.temperature == 0 for row in rows])
        tokens_B = torch.where(greedy_B.to(drawn_B.device), scores_BV.argmax(-1), drawn_B)
        chosen_B = logprobs_BV.gather(-1, tokens_B[:, None]).squeeze(-1)
        for row, token, logprob in zip(rows, tokens_B.tolist(), chosen_B.tolist(), strict=True):
            row.tokens.append(token)
            row.logprobs.append(logprob)
            row.length += 1
        return tokens_B.cpu()

    def _finish_rows(self) -> None:
        """Hand finished rows to their jobs and drop them (and the padding no row needs) from the
        batch."""
        keep = []
        for b, row in enumerate(self.rows):
            stopped = self._stopped(row)
            if not stopped and len(row.tokens) < row.job.settings.max_tokens:
                keep.append(b)
                continue
            job = row.job
            job.completions[row.index] = Completion(row.tokens, row.logprobs, finished=stopped)
            job.unfinished -= 1
            if job.unfinished == 0 and job.error is None:
                job.done.set()
        if len(keep) == len(self.rows):
            return
        if not keep:
            self.rows, self.cache, self.mask_BL, self.next_B = [], None, None, None
            return
        index = torch.tensor(keep)
        self.rows = [self.rows[b] for b in keep]
        self.cache.batch_select_indices(index.to(self.device))
        self.mask_BL, self.next_B = self.mask_BL[index], self.next_B[index]
        unused = int((self.mask_BL.cumsum(-1) == 0).sum(-1).min())
        if unused and self._mergeable():
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, unused:], layer.values[:, :, unused:]
            self.mask_BL = self.mask_BL[:, unused:]

    def _stopped(self, row: _Row) -> bool:
        settings = row.job.settings
        if row.tokens[-1] in settings.stop_token_ids:
            return True
        return ends_in_stop_string(self.tokenizer, row.tokens, settings.stop_strings)


def _left_pad(tensor: torch.Tensor, length: int) -> torch.Tensor:
    """``tensor`` (batch first; positions on dim 1 of a mask, dim 2 of keys and values) with
    zeros on the left up to ``length`` positions."""
    dim = 1 if tensor.dim() == 2 else 2
    missing = length - tensor.shape[dim]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)
