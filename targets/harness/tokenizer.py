"""The offline tokenizers of random-weight targets (``model.tokenizer``), built with the ``tokenizers``
library (no hub), and the stop tokens of any model directory.

* ``words``: a word-level vocabulary the harness's own environments speak. Words are
  whitespace-separated; ids past the named words are filler tokens ``<uN>`` so the tokenizer covers
  the model's whole vocabulary (a random model emits them, and they decode cleanly).
* ``bpe``: a byte-level BPE trained here on ``tokenizer_corpus.txt`` (text of the kind real
  environments write: game rules, hints, arithmetic), with ChatML special tokens and chat template,
  as Qwen's: what a target whose environment speaks its own text uses (any text encodes).
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
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


def build_tokenizer(vocab_size: int, kind: str = "words") -> PreTrainedTokenizerFast:
    """The ``kind`` of tokenizer (``words`` or ``bpe``) covering ``vocab_size`` ids exactly."""
    if kind == "bpe":
        return build_chat_tokenizer(vocab_size)
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


CORPUS = Path(__file__).with_name("tokenizer_corpus.txt")
END_OF_TEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (  # ChatML, as Qwen's templates render a conversation
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
MIN_BPE_VOCAB = 256 + 3  # every byte, and the three special tokens


def build_chat_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE of exactly ``vocab_size`` ids trained on the bundled corpus (deterministic:
    the same ids on every machine), ending a turn with ``<|im_end|>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < MIN_BPE_VOCAB:
        raise ValueError(
            f"model.config.vocab_size {vocab_size} is too small for a byte-level BPE (at least {MIN_BPE_VOCAB})"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(CORPUS)], trainer)
    # a corpus with fewer merges than asked: named fillers, special so an environment never reads them as
    # text (a random 0.6B model samples them nearly always, and their digits would score arithmetic)
    filler = vocab_size - tokenizer.get_vocab_size()
    if filler:
        tokenizer.add_special_tokens([f"<|filler_{i}|>" for i in range(filler)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=IM_END, pad_token=END_OF_TEXT, chat_template=CHAT_TEMPLATE
    )


def tokenizer_key(kind: str | None):
    """What determines a built tokenizer (part of a random model's content hash)."""
    if kind == "bpe":
        return ["bpe", hashlib.sha256(CORPUS.read_bytes()).hexdigest()[:16], CHAT_TEMPLATE, "special fillers"]
    return NAMED_VOCAB


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
STOP_TOKEN_IDS = (VOCAB.ids[EOS],)  # the word-level tokenizer's (``stop_token_ids`` of its directory)


def stop_token_ids(model_dir: Path) -> tuple[int, ...]:
    """The tokens every turn stops on (``Runtime.stop_token_ids``; the audit holds each request to
    them): the model's own, read from its directory: the tokenizer's end of sequence (where transformers
    reads it: ``tokenizer_config.json``, and ``special_tokens_map.json``, which some checkpoints alone
    carry), the generation config's end ids (a chat model ends its turn on one of them), and the special
    token its chat template closes an assistant's turn with (``chat_turn_end``)."""
    from tokenizers import Tokenizer  # the Rust library (transformers only for a chat template's turn end)

    model_dir = Path(model_dir)
    vocabulary = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids: set[int] = set()
    for config_path in (model_dir / "tokenizer_config.json", model_dir / "special_tokens_map.json"):
        eos = json.loads(config_path.read_text()).get("eos_token") if config_path.exists() else None
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if eos is not None:
            eos_id = vocabulary.token_to_id(eos)
            if eos_id is None:
                raise ValueError(f"{config_path}: eos_token {eos!r} is not in the tokenizer's vocabulary")
            ids.add(eos_id)
    generation = model_dir / "generation_config.json"
    if generation.exists():
        stated = json.loads(generation.read_text()).get("eos_token_id")
        ids.update([stated] if isinstance(stated, int) else stated or [])
    if has_chat_template(model_dir) and (turn_end := chat_turn_end(model_dir)) is not None:
        ids.add(turn_end)
    if not ids:
        raise ValueError(f"{model_dir}: the tokenizer names no end-of-sequence token, so no turn could stop")
    return tuple(sorted(ids))


@functools.lru_cache(maxsize=8)
def chat_turn_end(model_dir: Path) -> int | None:
    """The special token a chat template closes an assistant's turn with (``<|im_end|>``), where it is one:
    a base model's eos is its end of text, and its turns, rendered by its template, ran on past their end
    into a turn of the user's the model made up (a review of user models). None where the template closes a
    turn with plain text (a newline is no stop). Read as an episode's next turn is rendered (``ChatFormat``,
    which names a template that does not render)."""
    from transformers import PreTrainedTokenizerFast

    from targets.harness.environments.chat_format import ChatFormat

    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    ids = ChatFormat(tokenizer, ()).next("", None)  # what follows an action: the turn's close first
    added = tokenizer.added_tokens_decoder.get(ids[0]) if ids else None
    return ids[0] if added is not None and added.special else None


def defined_ids(model_dir: Path, embedded: int) -> int:
    """How many ids a check may prompt with: those the model's tokenizer defines (its added tokens
    included) that its embedding of ``embedded`` rows holds."""
    from tokenizers import Tokenizer

    defined = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    return min(embedded, defined)


def speaks_harness_words(model_dir: Path) -> bool:
    """Whether a model directory's tokenizer gives the harness's words their ids (``NAMED_VOCAB``'s order),
    as the directories built for ``random(seed)`` with the word tokenizer do: the built-in environments
    write and read those ids. Read from ``tokenizer.json`` without loading it."""
    path = Path(model_dir) / "tokenizer.json"
    try:
        vocab = json.loads(path.read_text()).get("model", {}).get("vocab")
    except (OSError, json.JSONDecodeError, AttributeError):  # none, not JSON, not an object: not ours
        return False
    return isinstance(vocab, dict) and all(vocab.get(word) == i for i, word in enumerate(NAMED_VOCAB))


def has_chat_template(model_dir: Path) -> bool:
    """Whether a model directory's tokenizer carries a chat template (in ``tokenizer_config.json`` or
    beside it, as transformers saves one), read without loading the tokenizer."""
    model_dir = Path(model_dir)
    config = model_dir / "tokenizer_config.json"
    try:
        if config.exists() and json.loads(config.read_text()).get("chat_template"):
            return True
    except (json.JSONDecodeError, AttributeError) as error:  # not JSON, or not an object
        raise ValueError(f"{config}: not a tokenizer config ({error})") from None
    return any((model_dir / name).exists() for name in ("chat_template.jinja", "chat_template.json"))
