"""A teacher's settings, as the config's ``teacher`` (and ``datasets[i].teacher``) sections hold
them."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

from opd.checks import range_problems
from opd.locations import device_problem, missing_path_problem, url_problem
from opd.teachers.context import PrivilegedContext, template_fields

STUDENT = "student"
"""``teacher.model`` naming the student's own starting weights."""


@dataclass
class TeacherConfig:
    """The model whose per-token judgement trains the student. Scored in one no-grad forward."""

    model: str = ""
    """Hugging Face model id or local directory (``local``), or the served model name (remote).
    ``student`` (local): the student's own starting weights, loaded once more and frozen: with a
    ``context``, self-distillation from the student shown what it is not. Required unless
    ``mixture`` is given."""
    backend: Literal["local", "openai", "sglang"] = "local"
    """``local``: in the trainer's process; ``openai``: a vLLM (OpenAI-compatible) server;
    ``sglang``: an SGLang server. Remote teachers must share the student's token ids."""
    base_url: str | list[str] | None = None
    """Remote server, as OpenAI clients take it: ``http://127.0.0.1:8000/v1`` (vLLM),
    ``http://127.0.0.1:30000`` (SGLang); or a list of replicas of one teacher, which requests go
    round (a replica that fails leaves the rotation until it answers a probe as before)."""
    api_key_env: str | None = None
    """Name of the environment variable holding the server's API key (the key is never logged or
    saved)."""
    tokenizer: str | None = None
    """The teacher's tokenizer (id or path), checked against the student's; default: ``model`` when
    local."""
    chat_template: str | None = None
    """Render prompts for the teacher in its own format: a Jinja template, or ``tokenizer`` for
    the teacher tokenizer's template. Unset: the teacher sees the student's rendering."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """With ``chat_template``: variables its template reads (``{enable_thinking: true}``)."""
    cross_tokenizer: bool = False
    """The teacher's tokenizer differs from the student's: completions are re-tokenized for it
    and aligned on character offsets (``sampled_reverse_kl``, ``k3`` and ``topk_forward_kl`` on
    student samples, ``nll`` on the teacher's own)."""
    character_topk: int = 20
    """Cross-tokenizer only: the teacher's likely tokens per position, from which its answer is
    read per character, so each student token is credited for its own characters (0: a token's
    characters share its log-prob evenly), and ``topk_forward_kl`` reads its next-token
    distribution in the student's tokens. A remote server must send this many (vLLM
    ``--max-logprobs``, 20 by default)."""
    timeout_s: float = 60.0
    """Remote: seconds to wait for one answer before retrying."""
    max_retries: int = 4
    """Remote: retries after a connection error, timeout or 5xx (exponential backoff with
    jitter)."""
    max_concurrency: int = 4
    """Remote: scoring requests in flight at once."""
    request_batch_size: int = 8
    """Remote (openai): sequences per scoring request. A teacher that writes completions sends
    one request a row (each with its own seed), ``max_concurrency`` x ``request_batch_size`` in
    flight at once: as many sequences as scoring has in flight."""
    replica_probes: int = 4
    """Remote: before any step, the same probe sequence is scored this many times, each on a
    connection of its own; replicas behind one address that answer it otherwise (another model,
    revision or quantization) are refused, naming the address (0: no probe)."""
    replica_rest_s: float = 30.0
    """Remote, several ``base_url``: seconds a replica out of rotation rests before it is probed
    again (and taken back when it answers the start's probe as before)."""
    context: str | None = None
    """Privileged context: text the teacher reads before the student's prompt and the student
    never sees, a template over the prompt's fields, e.g. ``"The correct answer is {answer}."``
    (``{answer}``, ``{completion}``, ``{metadata.<key>}``). Every prompt of the datasets it
    scores must have each field it reads (checked before any work)."""
    context_role: Literal["system", "user"] = "system"
    """Where the context goes: a system message (joined to the prompt's own system message when
    it has one), or the head of the first user message."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Local: weights dtype, as for the student."""
    device: str = "auto"
    """Local: device, as for the student."""
    trust_remote_code: bool = False
    """Local: run model code shipped in the checkpoint."""
    mixture: list[MixtureMember] | None = None
    """Several teachers mixed token by token, ``q(x) = sum_i weight_i q_i(x)``: each entry a whole
    teacher (``model``, ``backend``, ``chat_template``, ``context``, ...) with its ``weight``, the
    weights summing to 1. Set nothing else beside it. ``sampled_reverse_kl`` and ``k3`` read the
    mixture's exact log-prob of each sampled token; ``topk_forward_kl`` the union of the
    teachers' top-k (docs/teachers.md gives the formula and its bound); ``jsd`` the mixed full
    distribution (every member local)."""

    def problems(self) -> Iterator[tuple[str, str]]:
        """``(field, problem)`` for this teacher's own settings, found before any model loads or
        server is asked (what it is asked for, by the objective, is checked in
        ``opd.config.rules``)."""
        if self.mixture is not None:
            yield from self._mixture_problems()
            return
        if not self.model:
            yield (
                "model",
                (
                    "required: a Hugging Face id or directory (local), the served model's name "
                    "(remote) or student; or give mixture: [{model: ..., weight: ...}, ...]"
                ),
            )
        if self.context is not None:
            try:
                if not template_fields(self.context) and not self.context.strip():
                    yield (
                        "context",
                        "is empty: give a template such as 'The correct answer is {answer}.'",
                    )
            except ValueError as error:
                yield "context", str(error)
        places = [("tokenizer", missing_path_problem)]
        places += (
            [("model", missing_path_problem), ("device", device_problem)]
            if self.backend == "local"
            else [("base_url", url_problem)]
        )
        for key, check in places:
            value = getattr(self, key)
            for index, one in enumerate(value if isinstance(value, list) else [value]):
                where = f"{key}[{index}]" if isinstance(value, list) else key
                if one and (problem := check(one)):
                    yield where, problem
        if isinstance(self.base_url, list) and len(set(self.base_url)) < len(self.base_url):
            yield "base_url", f"names a replica twice: {self.base_url}"
        yield from range_problems(  # every range, whichever backend reads the field: a value that
            self,  # can never be right is refused wherever it is written
            positive=("timeout_s", "max_concurrency", "request_batch_size", "replica_rest_s"),
            non_negative=("character_topk", "max_retries", "replica_probes"),
        )
        if self.cross_tokenizer and self.backend != "local" and not self.tokenizer:
            yield "tokenizer", "required for cross_tokenizer with a remote teacher"
        if self.chat_template_kwargs and not self.chat_template:
            yield (
                "chat_template_kwargs",
                (
                    "read by the teacher's own template only; set chat_template (tokenizer, or a "
                    "Jinja template), or remove them (the teacher sees the student's rendering, "
                    "student.chat_template_kwargs included)"
                ),
            )
        if self.chat_template == "tokenizer" and self.backend != "local" and not self.tokenizer:
            yield "tokenizer", "required to use the tokenizer's chat template of a remote teacher"
        if self.backend == "local":
            return
        if not self.base_url:
            yield "base_url", f"required for backend '{self.backend}'"

    def _mixture_problems(self) -> Iterator[tuple[str, str]]:
        """A mixture names its members and nothing beside them; their weights sum to 1."""
        if not self.mixture:
            yield "mixture", "is empty: give at least one member, [{model: ..., weight: 1.0}]"
            return
        alone = TeacherConfig(mixture=self.mixture)
        for name in (f.name for f in fields(self)):
            if getattr(self, name) != getattr(alone, name):
                yield name, f"is set on each member (mixture[i].{name}), not beside mixture"
        weights = [member.weight for member in self.mixture]
        if abs(sum(weights) - 1.0) > 1e-6:
            listed = ", ".join(map(str, weights))
            yield "mixture", f"the weights must sum to 1, got {sum(weights):g} ({listed})"

    def load_key(self) -> tuple:
        """What makes two sections one loaded teacher: the same model or server, dtype and
        device (datasets that name it alike share its weights or its connections)."""
        return (self.backend, repr(self.base_url), self.model, self.dtype, self.device)

    def format_key(self) -> tuple:
        """What makes two sections read the student's rollouts alike: the same tokenizer,
        template (and its variables: thinking on and off are two formats), alignment, and
        whether a context re-renders the conversation."""
        return (
            self.tokenizer or self.model,
            self.chat_template,
            repr(sorted(self.chat_template_kwargs.items())),
            self.cross_tokenizer,
            self.character_topk,
            self.context is not None,
        )

    @property
    def members(self) -> list[tuple[TeacherConfig, float]]:
        """The teachers it mixes with their weights (itself with weight 1 when it mixes none)."""
        if self.mixture is None:
            return [(self, 1.0)]
        return [(member, member.weight) for member in self.mixture]

    @property
    def privileged_context(self) -> PrivilegedContext | None:
        """The context it is shown, where it goes (None: it reads the student's conversation)."""
        return None if self.context is None else PrivilegedContext(self.context, self.context_role)

    def of_student(
        self, model: str, tokenizer: str | None, trust_remote_code: bool
    ) -> TeacherConfig:
        """This teacher (each member of a mixture) with ``model: student`` (local) read as the
        student's own checkpoint."""
        if self.mixture is not None:
            members = [m.of_student(model, tokenizer, trust_remote_code) for m in self.mixture]
            return replace(self, mixture=members)
        if self.backend != "local" or self.model != STUDENT:
            return self
        return replace(
            self,
            model=model,
            tokenizer=self.tokenizer or tokenizer,
            trust_remote_code=trust_remote_code,
        )


@dataclass
class MixtureMember(TeacherConfig):
    """One teacher of a mixture: a whole teacher's settings and its share."""

    weight: float = 0.0
    """Required: its share of the mixture, in (0, 1]; the members' weights sum to 1."""

    def problems(self) -> Iterator[tuple[str, str]]:
        if self.mixture is not None:
            yield "mixture", "mixtures do not nest: list every teacher in one mixture"
            return
        yield from super().problems()
        if self.weight == 0.0:
            yield "weight", "required: its share of the mixture, in (0, 1]"
        elif not 0.0 < self.weight <= 1.0:
            yield "weight", f"must be in (0, 1], got {self.weight}"
