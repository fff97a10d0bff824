"""Privileged context: what a teacher is shown that the student is not (the reference answer, a
worked solution, a hint), written from each prompt's own fields into the teacher's conversation.

``teacher.context`` is a template over the prompt's fields: ``{answer}``, ``{completion}``,
``{metadata.<key>}`` (``{metadata.a.b}`` for nested entries; ``{{`` and ``}}`` for braces). The
teacher reads it as a system message (``context_role: system``: joined to the prompt's own
system message when it has one) or at the head of the first user message (``user``: a second
user message in a row breaks some chat templates). The student's prompt, its tokens and its
completion are untouched: only the teacher's rendering of the conversation is longer.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from typing import Any

from opd.data.prompts import Prompt

FIELDS = ("answer", "completion")
"""Top-level fields a context may read besides ``metadata.<key>``."""


def template_fields(template: str) -> list[str]:
    """The fields ``template`` reads, in order; a ValueError names what is wrong with it."""
    fields = []
    for _, name, spec, conversion in string.Formatter().parse(template):
        if name is None:
            continue
        if spec or conversion:
            raise ValueError(
                f"{{{name}}}: write a field as {{answer}} or {{metadata.key}}, with no format spec"
            )
        if name not in FIELDS and not (
            name.startswith("metadata.") and len(name) > len("metadata.")
        ):
            raise ValueError(
                f"{{{name}}} is not a prompt field: use {{answer}}, {{completion}} or "
                f"{{metadata.<key>}}"
            )
        fields.append(name)
    return fields


def _value(prompt: Prompt, name: str) -> Any:
    """The prompt's value of field ``name`` (None when it has none)."""
    if name in FIELDS:
        return getattr(prompt, name)
    value: Any = prompt.metadata
    for key in name.split(".")[1:]:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def available_fields(prompt: Prompt) -> list[str]:
    """The fields ``prompt`` has a value for, as a context names them."""
    names = [name for name in FIELDS if getattr(prompt, name) is not None]

    def walk(value: Any, prefix: str) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(inner, f"{prefix}.{key}")
        elif value is not None:
            names.append(prefix)

    walk(prompt.metadata, "metadata")
    return names


@dataclass(frozen=True)
class PrivilegedContext:
    """A teacher's ``context`` template and where its text goes in the conversation."""

    template: str
    role: str = "system"

    def text(self, prompt: Prompt) -> str:
        """The context written from ``prompt``'s fields (checked by :meth:`missing` beforehand)."""
        values = {name: _value(prompt, name) for name in template_fields(self.template)}
        pieces = []
        for literal, name, _, _ in string.Formatter().parse(self.template):
            pieces.append(literal)
            if name is not None:
                pieces.append(str(values[name]))
        return "".join(pieces)

    def messages(self, prompt: Prompt) -> tuple[dict, ...]:
        """The conversation the teacher reads: the prompt's, with the context in it."""
        text, messages = self.text(prompt), [dict(m) for m in prompt.messages]
        if self.role == "system":
            if messages and messages[0].get("role") == "system":
                messages[0]["content"] = f"{messages[0]['content']}\n\n{text}"
            else:
                messages.insert(0, {"role": "system", "content": text})
        else:
            first = next((m for m in messages if m.get("role") == "user"), None)
            if first is None:
                messages.insert(0, {"role": "user", "content": text})
            else:
                first["content"] = f"{text}\n\n{first['content']}"
        return tuple(messages)

    def missing(self, prompts: list[Prompt], where: str) -> str | None:
        """Why ``prompts`` cannot fill the template: the first prompt lacking a field, named with
        the fields it has (None: every prompt has every field)."""
        fields = template_fields(self.template)
        for index, prompt in enumerate(prompts):
            lacking = [name for name in fields if _value(prompt, name) is None]
            if lacking:
                has = ", ".join(available_fields(prompt)) or "none"
                return (
                    f"{{{lacking[0]}}} is not a field of prompt {index} of {where}; its fields: "
                    f"{has}"
                )
        return None
