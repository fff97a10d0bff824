"""A completion's reward: what the task says of a sample, beside the teacher's per-token signal."""

from __future__ import annotations

from opd.data.graders import Grader
from opd.data.prompts import Prompt
from opd.data.sequences import Completion


def completion_reward(
    tokenizer, completion: Completion, prompt: Prompt, grader: Grader | None
) -> float | None:
    """An episode's reward (the sum of its steps'; 0 when its environment gave none), else the
    grade of the completion's text (special tokens removed) against the prompt; None without a
    grader."""
    if completion.trajectory is not None:
        return completion.trajectory.reward or 0.0
    if grader is None:
        return None
    return float(grader(tokenizer.decode(completion.token_ids, skip_special_tokens=True), prompt))
