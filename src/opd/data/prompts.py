"""Prompts: the record every source yields, validated; JSONL prompt files; reasoning-gym tasks.
``opd.data.sources`` picks the source a config names."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opd.errors import DataError

VALID_ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Prompt:
    """One prompt: the conversation so far, and the reference answer when the task has one."""

    messages: tuple[dict[str, str], ...]
    answer: str | None = None
    completion: str | None = None
    metadata: dict[str, Any] | None = field(default=None, compare=False)
    """The generator's entry, for graders that need more than the answer (reasoning-gym)."""


def _encodable(text: str, where: str, field: str) -> str:
    """``text``, refused when it holds a lone surrogate (JSON allows ``"\ud800"``; tokenizers fail
    on it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise DataError(
            f"{where}: '{field}' holds an unpaired surrogate {text[error.start]!r} at character "
            f"{error.start}"
        ) from None
    return text


def _messages_from(record: dict, where: str) -> tuple[dict[str, str], ...]:
    if "prompt" in record:
        text = record["prompt"]
        if not isinstance(text, str):
            raise DataError(f"{where}: 'prompt' must be a string, got {type(text).__name__}")
        _encodable(text, where, "prompt")
        if not text.strip():
            raise DataError(f"{where}: empty prompt")
        return ({"role": "user", "content": text},)
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        raise DataError(
            f"{where}: 'messages' must be a non-empty list of {{role, content}} objects"
        )
    checked = []
    for j, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise DataError(f"{where}: messages[{j}] needs a string 'content'")
        if message.get("role") not in VALID_ROLES:
            raise DataError(f"{where}: messages[{j}].role must be one of {VALID_ROLES}")
        content = _encodable(message["content"], where, f"messages[{j}].content")
        checked.append({"role": message["role"], "content": content})
    if not any(m["content"].strip() for m in checked):
        raise DataError(f"{where}: empty prompt (every message is blank)")
    return tuple(checked)


def _optional_text(record: dict, key: str, where: str) -> str | None:
    value = record.get(key)
    if value is None:
        return None
    if isinstance(value, int | float) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise DataError(f"{where}: '{key}' is {value}, not a finite number")
        return str(value)
    if not isinstance(value, str):
        raise DataError(f"{where}: '{key}' must be a string or number")
    return _encodable(value, where, key)


def parse_prompt_record(record: object, where: str) -> Prompt:
    """Validate one decoded JSON object: ``prompt`` or ``messages``, optional
    answer/completion/metadata."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "prompt" not in record and "messages" not in record:
        raise DataError(f"{where}: needs a 'prompt' string or a 'messages' list")
    metadata = record.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise DataError(f"{where}: 'metadata' must be a JSON object (e.g. a reasoning-gym entry)")
    return Prompt(
        messages=_messages_from(record, where),
        answer=_optional_text(record, "answer", where),
        completion=_optional_text(record, "completion", where),
        metadata=metadata,
    )


def load_jsonl_prompts(path: str | Path) -> list[Prompt]:
    """Read a JSONL prompt file; any bad line raises :class:`DataError` with ``file:line``."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: prompt file not found")
    prompts = []
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            where = f"{path}:{number}"
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as error:
                raise DataError(
                    f"{where}: not UTF-8 text (byte {raw[error.start]:#04x} at column "
                    f"{error.start + 1}); save the file as UTF-8"
                ) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(
                    f"{where}: malformed JSON ({error.msg} at column {error.colno})"
                ) from None
            except RecursionError:
                raise DataError(f"{where}: JSON nested too deeply to be a prompt") from None
            prompts.append(parse_prompt_record(record, where))
    if not prompts:
        raise DataError(f"{path}: no prompts in the file")
    return prompts


SEED_BLOCK = 2**20
"""reasoning-gym makes item ``i`` of a dataset seeded ``s`` from seed ``s + i``, so datasets with
nearby seeds share items: each run seed gets its own block of this many item seeds for train
(seeds 2048 apart share one), and the test split a block ``2**31`` above it (below ``2**32``,
which numpy-seeded tasks need)."""


def reasoning_gym_seed(seed: int, split: str) -> int:
    """The reasoning-gym dataset seed of a split: train and test never share an item seed."""
    return (seed * SEED_BLOCK) % 2**31 + (2**31 if split == "test" else 0)


def reasoning_gym_prompts(
    spec: str, *, seed: int, count: int, task_config: dict[str, Any]
) -> list[Prompt]:
    """``<task>`` or ``<task>@test`` from reasoning-gym (offline generators), with their graders'
    entries.

    The splits come from disjoint seed blocks; a task with few distinct questions (two one-digit
    terms) still repeats some by chance, as any sample from a small space does.
    """
    try:
        import reasoning_gym
    except ImportError:
        raise DataError(
            f"reasoning_gym:{spec}: the reasoning-gym package is not installed; pip install "
            "'opd[tasks]'"
        ) from None
    task, _, split = spec.partition("@")
    if split not in ("", "train", "test"):
        raise DataError(f"reasoning_gym:{spec}: unknown split '{split}'; use @train or @test")
    if count > SEED_BLOCK:
        raise DataError(
            f"reasoning_gym:{spec}: count {count} is more than {SEED_BLOCK} prompts per split; "
            "lower it, or write the prompts to a JSONL file and use that as the source"
        )
    try:
        dataset = reasoning_gym.create_dataset(
            task, size=count, seed=reasoning_gym_seed(seed, split or "train"), **task_config
        )
    except Exception as error:
        raise DataError(f"reasoning_gym:{spec}: cannot create the task ({error})") from error
    return [
        Prompt(
            messages=({"role": "user", "content": entry["question"]},),
            answer=str(entry["answer"]),
            metadata=entry,
        )
        for entry in dataset
    ]
