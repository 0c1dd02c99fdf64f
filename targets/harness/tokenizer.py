"""The offline tokenizer: a word-level vocabulary the harness environments speak, built with the
``tokenizers`` library (no hub). Words are whitespace-separated; ids past the named words are
filler tokens ``<uN>`` so the tokenizer covers the model's whole vocabulary (a random model emits
them, and they decode cleanly).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where a tokenizer is built: a simulated run never needs them
    from transformers import PreTrainedTokenizerFast

PAD, EOS, OBS, ACT, CTX = "<pad>", "<eos>", "<obs>", "<act>", "<ctx>"
SPECIAL_WORDS = [PAD, EOS, OBS, ACT, CTX]
DIGITS = [str(d) for d in range(10)]
LETTERS = [chr(ord("a") + i) for i in range(26)]
WORDS = [
    "guess",
    "number",
    "between",
    "and",
    "higher",
    "lower",
    "correct",
    "invalid",
    "repeat",
    "ok",
    "done",
    "timeout",
]
NAMED_VOCAB = SPECIAL_WORDS + DIGITS + LETTERS + WORDS
FILLER_PREFIX = "<u"  # filler token N is the word "<uN>"


def build_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < len(NAMED_VOCAB):
        raise ValueError(
            f"model.config.vocab_size {vocab_size} is smaller than the harness vocabulary ({len(NAMED_VOCAB)} words)"
        )
    vocab = {word: i for i, word in enumerate(NAMED_VOCAB)}
    vocab.update({f"{FILLER_PREFIX}{i}>": i for i in range(len(NAMED_VOCAB), vocab_size)})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=CTX))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token=PAD, eos_token=EOS, unk_token=CTX)


class Vocab:
    """Word <-> id for environments; the ids are fixed by ``NAMED_VOCAB``'s order."""

    def __init__(self) -> None:
        self.ids = {word: i for i, word in enumerate(NAMED_VOCAB)}
        self.words = list(NAMED_VOCAB)

    def encode(self, text: str) -> list[int]:
        return [self.ids[w] for w in text.split()]

    def word(self, token: int) -> str:
        return self.words[token] if 0 <= token < len(self.words) else f"{FILLER_PREFIX}{token}>"


VOCAB = Vocab()
# The tokens every turn stops on (``Runtime.stop_token_ids``): the audit holds each request to them.
STOP_TOKEN_IDS = (VOCAB.ids[EOS],)
