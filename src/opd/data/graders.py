"""Graders: how a completion is scored against a prompt's reference answer, in [0, 1]."""

from __future__ import annotations

import importlib.util
import re
import threading
from collections.abc import Callable
from functools import cache

from opd.data.prompts import Prompt

Grader = Callable[[str, Prompt], float]
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def exact_match(completion: str, prompt: Prompt) -> float:
    """1.0 when the completion, stripped of surrounding whitespace, is exactly the answer."""
    return float(completion.strip() == (prompt.answer or "").strip())


def last_number(text: str) -> float | None:
    """The last number written in ``text`` (thousands separators allowed), or None."""
    found = NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def last_number_match(completion: str, prompt: Prompt) -> float:
    """1.0 when the last number in the completion equals the answer's number."""
    expected, got = last_number(prompt.answer or ""), last_number(completion)
    return float(expected is not None and got is not None and abs(expected - got) < 1e-9)


@cache
def _reasoning_gym_scorer(task: str):
    import reasoning_gym

    return reasoning_gym.create_dataset(task, size=1, seed=0).score_answer


def reasoning_gym_score(completion: str, prompt: Prompt) -> float:
    """The task's own scorer, from ``reasoning-gym``, on the entry the prompt was generated from.

    The entry comes from a ``reasoning_gym:`` source or a JSONL record's ``metadata``.
    """
    entry = prompt.metadata
    if not entry or "metadata" not in entry or "source_dataset" not in entry["metadata"]:
        raise ValueError(
            "the reasoning_gym grader needs prompts from a reasoning_gym: source, or JSONL records "
            "whose 'metadata' is the reasoning-gym entry ({question, answer, metadata})"
        )
    from reasoning_gym.utils import extract_answer

    scorer = _reasoning_gym_scorer(entry["metadata"]["source_dataset"])
    tagged = extract_answer(
        completion
    )  # the last <answer>...</answer>, reasoning-gym's own convention
    return float(scorer(answer=completion if tagged is None else tagged, entry=entry))


ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def _whole(text: str) -> tuple[int, int] | None:
    stripped = text.strip()
    if not stripped:
        return None
    start = text.index(stripped)
    return start, start + len(stripped)


def _last_number_span(text: str) -> tuple[int, int] | None:
    found = list(NUMBER.finditer(text))
    return (found[-1].start(), found[-1].end()) if found else None


def _tagged_span(text: str) -> tuple[int, int] | None:
    found = list(ANSWER_TAG.finditer(text))
    if not found:
        return None
    inner = found[-1].group(1)
    stripped = inner.strip()
    start = found[-1].start(1) + (inner.index(stripped) if stripped else 0)
    return start, start + len(stripped)


def _number_text(text: str | None) -> str | None:
    found = NUMBER.findall(text or "")
    return found[-1] if found else None


def _rg_answer(prompt: Prompt) -> str | None:
    entry = prompt.metadata or {}
    answer = entry.get("answer", prompt.answer)
    return None if answer is None else str(answer).strip()


ANSWER_LOCATORS: dict[Grader, tuple[Callable, Callable]] = {
    exact_match: (_whole, lambda prompt: (prompt.answer or "").strip() or None),
    last_number_match: (_last_number_span, lambda prompt: _number_text(prompt.answer)),
    reasoning_gym_score: (_tagged_span, _rg_answer),
}
"""Where a grader reads the answer in a completion's text (a (start, end) character span, None
when it finds none) and the reference text it compares it with, for the graders that can say:
the diagnostics split the teacher KL at the answer and find where a wrong answer parts from the
right one."""


def answer_location(
    grader: Grader | None, text: str, prompt: Prompt
) -> tuple[int, int, str] | None:
    """``(start, end, reference)``: the answer's characters in ``text`` and the right answer, or
    None where the grader cannot say (another grader, no answer written, no reference)."""
    locators = ANSWER_LOCATORS.get(grader)
    if locators is None:
        return None
    span, reference = locators[0](text), locators[1](prompt)
    if span is None or not reference:
        return None
    return span[0], span[1], reference


MATH_VERIFY_INSTALL = "pip install 'opd[math]' (Hugging Face's math-verify)"
MATH_VERIFY_TIMEOUT_S = 5
"""Seconds Math-Verify may spend parsing or comparing one answer (on the main thread: its alarm
works there only; elsewhere it runs without one)."""


def math_verify_available() -> bool:
    """Whether ``math_verify`` can be imported here (checked without importing it)."""
    return importlib.util.find_spec("math_verify") is not None


def math_verify_score(completion: str, prompt: Prompt) -> float:
    """1.0 when Math-Verify finds the completion's answer mathematically equal to the prompt's:
    LaTeX (``\\boxed{...}``, ``\\frac``, sets, intervals) or plain expressions (``1/2`` = ``0.5``),
    as TRL's accuracy reward reads them; 0.0 when they differ, or either has no parsable answer."""
    if not math_verify_available():
        raise ModuleNotFoundError(
            f"the math_verify grader needs the math-verify package; {MATH_VERIFY_INSTALL}"
        )
    from math_verify import parse, verify

    limit = MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    reference = (prompt.answer or "").strip()
    if "$" not in reference and "\\boxed" not in reference:
        # a bare reference answer is LaTeX (or a plain expression) in maths mode
        reference = f"${reference}$"
    gold = parse(reference, parsing_timeout=limit)
    answer = parse(completion, parsing_timeout=limit)
    if not gold or not answer:
        return 0.0
    return float(verify(gold, answer, timeout_seconds=limit))


GRADERS: dict[str, Grader] = {
    "exact_match": exact_match,
    "last_number": last_number_match,
    "reasoning_gym": reasoning_gym_score,
    "math_verify": math_verify_score,
}


def grader_for(name: str, source: str) -> Grader | None:
    """Resolve ``auto``: the task's scorer for reasoning-gym sources, else exact match; ``none`` is
    None."""
    if name == "none":
        return None
    if name == "auto":
        return reasoning_gym_score if source.startswith("reasoning_gym:") else exact_match
    return GRADERS[name]


def grader_of(name: str, source: str, prompts: list[Prompt]) -> Grader | None:
    """The grader for a dataset's prompts: :func:`grader_for`, or None when some prompt has no
    answer to grade against (reasoning-gym graders read the entry instead)."""
    grader = grader_for(name, source)
    if grader is not None and name != "reasoning_gym" and any(p.answer is None for p in prompts):
        return None
    return grader
