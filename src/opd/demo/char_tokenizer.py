"""A character-level tokenizer with a ChatML chat template, built offline with ``tokenizers``.

Small vocabularies keep the lm head cheap, so tiny models train in seconds on a CPU while
exercising the same chat-template, stop-token and padding paths as a real model.
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] "
    "}}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ("<|pad|>", "<|im_start|>", "<|im_end|>")


def build_char_tokenizer(
    alphabet: str = string.printable, chat_template: str | None = CHATML_TEMPLATE
):
    """A fast HF tokenizer: one id per character of ``alphabet``, plus pad / im_start / im_end."""
    characters = sorted(set(alphabet))
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for character in characters:
        vocab.setdefault(character, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|pad|>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return with_chat_specials(backend, chat_template)


def with_chat_specials(backend: Tokenizer, chat_template: str | None = CHATML_TEMPLATE):
    """A ``tokenizers`` backend as an HF tokenizer with the specials and template above."""
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<|pad|>",
        eos_token="<|im_end|>",
        bos_token=None,
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = chat_template
    return tokenizer
