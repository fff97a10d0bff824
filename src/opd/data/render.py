"""Turn conversations into the token ids the student continues, and know where a turn ends."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

REPLY_MARK = "\u2063opd-turn\u2063"
"""Stands in for a student's turn when a conversation is rendered to find what follows the turn."""
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")
PLAIN_STOP_STRING = "\n\nUser:"


class ChatRenderer:
    """Renders prompts with the tokenizer's chat template (generation prompt added).

    A tokenizer without a template (a base model) falls back to a plain format,
    ``User: {q}\\n\\nAssistant:``, stopping at ``\\n\\nUser:``, with a warning: pass
    ``chat_template`` to choose the format instead. ``template_kwargs`` reach the template as
    variables (Qwen3's ``enable_thinking``).
    """

    def __init__(
        self,
        tokenizer,
        chat_template: str | None = None,
        extra_stop_ids: Sequence[int] = (),
        template_kwargs: dict[str, Any] | None = None,
    ):
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        if chat_template is not None:
            tokenizer.chat_template = chat_template
        self.plain = not getattr(tokenizer, "chat_template", None)
        if self.plain:
            warnings.warn(
                f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; using "
                "the plain 'User: ...\\n\\nAssistant:' format. Set student.chat_template to "
                "choose one.",
                stacklevel=2,
            )
        self.stop_token_ids = self._stop_ids(extra_stop_ids)
        self.stop_strings = [PLAIN_STOP_STRING] if self.plain else []

    def _stop_ids(self, extra: Sequence[int]) -> list[int]:
        ids = [i for i in extra if i is not None]
        if self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        template = getattr(self.tokenizer, "chat_template", None) or ""
        vocab = self.tokenizer.get_vocab()
        ids += [
            vocab[token] for token in END_OF_TURN_TOKENS if token in template and token in vocab
        ]
        if not ids:
            raise ValueError(
                "the tokenizer has no EOS token and no end-of-turn token; cannot tell when to stop"
            )
        return sorted(set(ids))

    def render_text(self, messages: Sequence[dict[str, str]]) -> str:
        """The prompt as text, ending where the assistant's answer begins."""
        if self.plain:
            turns = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
            return "\n\n".join(turns) + "\n\nAssistant:"
        return self.tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=False, **self.template_kwargs
        )

    def prompt_ids(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """Token ids of the rendered prompt (special tokens come from the template itself)."""
        text = self.render_text(messages)
        add_special = self.plain and self.tokenizer.bos_token_id is not None
        return list(self.tokenizer(text, add_special_tokens=add_special)["input_ids"])

    def turn_text(self, turn_ids: Sequence[int]) -> str:
        """A sampled turn as the assistant message a conversation records (special tokens and the
        plain format's stop string removed)."""
        text = self.tokenizer.decode(list(turn_ids), skip_special_tokens=True)
        for stop in self.stop_strings:
            text = text.removesuffix(stop)
        return text

    def reply_ids(
        self,
        history: Sequence[dict[str, str]],
        turn_ids: Sequence[int],
        replies: Sequence[dict[str, str]],
    ) -> list[int]:
        """The token ids that follow a sampled turn when ``replies`` answer it: the turn's closing
        (what its own stop token did not write), the replies, and the next generation prompt.

        ``history`` is the conversation the turn answered. The template renders it with a mark in
        the turn's place and the replies after; the text after the mark, less what the turn
        already wrote (its end-of-turn token), is what the student reads next.
        """
        mark = {"role": "assistant", "content": REPLY_MARK}
        rendered = self.render_text([*history, mark, *replies])
        if REPLY_MARK not in rendered:
            raise ValueError(
                "the chat template dropped the assistant's turn; it cannot render a multi-turn "
                "episode"
            )
        after = rendered[rendered.index(REPLY_MARK) + len(REPLY_MARK) :]
        written = self.tokenizer.decode(list(turn_ids))
        overlap = next(
            (n for n in range(min(len(after), len(written)), 0, -1) if written.endswith(after[:n])),
            0,
        )
        return list(self.tokenizer(after[overlap:], add_special_tokens=False)["input_ids"])
