"""The model behind ``opd serve``: prompt log-probs with a top-k, and sampling for a teacher that
writes completions, one model forward at a time (a lock served in arrival order).

Sampling requests join one running decode (:mod:`opd.serve.batching`), which takes the model for
one step at a time, so the longest completion a client may ask for delays a scoring request by
one decode step, not by the whole completion (the model holds no state between forwards: the
decode's KV cache is its own).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from opd.data.sequences import Completion
from opd.logprobs import chunk_logits, head_weights
from opd.serve.batching import ContinuousBatcher, RowSettings, SampleJob
from opd.teachers.base import TeacherInput, TeacherRequest
from opd.teachers.local import LocalTeacher


class TurnLock:
    """A lock taken in the order it was asked for.

    ``threading.Lock`` lets a thread that releases and re-acquires it at once win again, so the
    decode loop, which takes the model back after every step, would keep it however often it let
    go; here it queues behind every thread that asked before it.
    """

    def __init__(self):
        self._turns = threading.Condition()
        self._next_ticket = 0
        self._serving = 0

    def _wait_for(self, ticket: int) -> None:
        self._turns.wait_for(lambda: self._serving == ticket)

    def __enter__(self) -> TurnLock:
        with self._turns:
            ticket, self._next_ticket = self._next_ticket, self._next_ticket + 1
            self._wait_for(ticket)
        return self

    def __exit__(self, *exc) -> None:
        with self._turns:
            self._serving += 1
            self._turns.notify_all()


class ServerBusy(Exception):
    """The model's queue is full: the request is refused before any work, to be sent again."""

    def __init__(self, retry_after_s: int, waiting: int):
        super().__init__(
            f"the server is busy: {waiting} requests are waiting for the model (--max-waiting); "
            f"send it again after {retry_after_s} s"
        )
        self.retry_after_s = retry_after_s


class ScoringModel:
    """Prompt log-probs and top-k of a causal LM, scored by the same code as a local teacher."""

    def __init__(
        self,
        model,
        tokenizer,
        name: str,
        max_logprobs: int = 20,
        max_tokens_per_request: int = 16384,
        max_waiting: int = 256,
    ):
        self.tokenizer = tokenizer
        self.name = name
        self.max_logprobs = max_logprobs
        self.max_tokens_per_request = max_tokens_per_request
        """The most tokens one request may have sampled, over all its prompts (rows x
        max_tokens)."""
        self.vocab_size = len(tokenizer)
        self.max_model_len = getattr(model.config, "max_position_embeddings", None)
        self.teacher = LocalTeacher(
            model, vocab_size=self.vocab_size, pad_id=tokenizer.pad_token_id or 0
        )
        self.lock = TurnLock()
        """The model, one forward at a time: a scoring request's, or a decode step's."""
        self.batcher = ContinuousBatcher(model, tokenizer, self.lock, self.teacher.pad_id)
        self.max_waiting = max_waiting
        """Requests held for the model at once (being served or waiting); more get 503."""
        self.waiting = 0
        self.request_seconds = 1.0
        """A recent request's time in the server (a moving average): the Retry-After of a 503."""
        self._count_lock = threading.Lock()

    @contextmanager
    def admitted(self) -> Iterator[None]:
        """Hold a place among the requests for the model, or raise :class:`ServerBusy` when all
        ``max_waiting`` are taken (the queue is bounded: a burst is told when to come back
        instead of piling up without end)."""
        with self._count_lock:
            if self.waiting >= self.max_waiting:
                raise ServerBusy(max(1, min(60, math.ceil(self.request_seconds))), self.waiting)
            self.waiting += 1
        started = time.monotonic()
        try:
            yield
        finally:
            with self._count_lock:
                self.waiting -= 1
                self.request_seconds = 0.8 * self.request_seconds + 0.2 * (
                    time.monotonic() - started
                )

    def sample(
        self,
        prompts: list[list[int]],
        temperature: float,
        max_tokens: int,
        seeds: list[int] | None,
        stop_token_ids: list[int],
        stop_strings: list[str],
    ) -> list[Completion]:
        """One completion per prompt from ``softmax(logits / temperature)`` (greedy at 0), each row
        drawn from its seed (None: a fresh one) as opd's own sampler draws it.

        The rows join the running decode (:class:`ContinuousBatcher`) and leave it as each ends,
        so requests that arrive while others decode share their forwards; a row's tokens do not
        depend on the rows it shares them with.
        """
        if seeds is None:
            seeds = torch.randint(0, 2**62, (len(prompts),)).tolist()
        settings = RowSettings(
            temperature, max_tokens, frozenset(stop_token_ids), tuple(stop_strings)
        )
        job = SampleJob(settings, prompts, seeds)
        self.batcher.submit(job)
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.completions

    def close(self) -> None:
        """Stop the sampling loop's thread (after the rows it has); sampling fails from then on,
        scoring goes on. The server calls it when it stops."""
        self.batcher.close()

    def score(
        self, prompts: list[list[int]], k: int
    ) -> list[list[tuple[float, int, list[tuple[int, float]]] | None]]:
        """Per prompt, per position: None at 0, else (log p(token), its rank, [(id, log p)] top-k by
        rank).

        The rank is vLLM's: one more than the number of ids the model finds strictly more likely.
        """
        inputs = TeacherInput.from_sequences(
            prompts, [[True] * len(p) for p in prompts], self.teacher.pad_id
        )
        with self.lock:
            scores = self.teacher.score(inputs, TeacherRequest(topk=max(k, 1), hidden=True))
            weight, bias = head_weights(scores.head, self.vocab_size)
            per_prompt = []
            for row, prompt in enumerate(prompts):
                length = len(prompt)
                values = scores.logprobs_BT[row, 1:length].tolist()
                logits, _ = chunk_logits(
                    scores.hidden_BTD[row, 1:length], weight, bias, scores.head_transform
                )
                chosen = logits.gather(-1, torch.tensor(prompt[1:], device=logits.device)[:, None])
                ranks = ((logits > chosen).sum(-1) + 1).tolist()
                top_ids = scores.topk_ids_BTK[row, 1:length, :k].tolist()
                top_values = scores.topk_logprobs_BTK[row, 1:length, :k].tolist()
                positions: list = [None]
                for value, rank, ids_k, values_k in zip(
                    values, ranks, top_ids, top_values, strict=True
                ):
                    positions.append((value, rank, list(zip(ids_k, values_k, strict=True))))
                per_prompt.append(positions)
        return per_prompt
