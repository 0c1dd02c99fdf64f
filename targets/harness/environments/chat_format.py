"""How a user environment's text becomes the tokens a stack trains on, with the model's own tokenizer
and chat template: the first observation is a user turn and the assistant's generation prompt; every
later observation is what the template puts after an assistant turn (its end, the next user turn, the
next generation prompt). The model's own tokens stay as it generated them: only the environment's
text is tokenized, so a trajectory is always the prompt, then action and observation tokens in turn
(the prefix the engines cache and the audit replays)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from targets.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ACTION = "\u2063ACTION\u2063"  # a placeholder no environment writes: where the assistant's text goes


class ChatTemplateError(UserError, ValueError):
    """The model's chat template cannot render an environment's turns."""


class ChatFormat:
    """``system``: the system message each episode's first turn carries; ``answer``: a regular expression
    whose last match (its group, where it has one) is what the environment reads of an action, "" where
    none matches (``EnvironmentRef``)."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        stop_ids: tuple[int, ...],
        system: str | None = None,
        answer: str | None = None,
    ) -> None:
        if not tokenizer.chat_template:
            raise ValueError("the model's tokenizer has no chat template: an environment's text cannot be rendered")
        self.tokenizer, self.stop_ids = tokenizer, frozenset(stop_ids)
        self.system, self.answer = system, re.compile(answer) if answer is not None else None
        self._check_template(tokenizer.name_or_path)

    def _check_template(self, where: str) -> None:
        """Both conversations a run renders, once, before any episode: a template that does not render (or
        drops the assistant's text, which the later turns are cut at) is named with its model, not met as a
        jinja traceback in the first episode."""
        turns = [{"role": "user", "content": "x"}, {"role": "assistant", "content": ACTION}]
        try:
            self.first_text("x")
            later = self._render([*turns, {"role": "user", "content": "y"}], True)
        except Exception as error:  # noqa: BLE001 - the user's template: named, whatever jinja raised
            raise ChatTemplateError(
                f"{where}: the chat template does not render a conversation ({type(error).__name__}: {error})"
            ) from None
        if ACTION not in later:
            raise ChatTemplateError(f"{where}: the chat template leaves out the assistant's turns")

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def first_text(self, observation: str) -> str:
        system = [{"role": "system", "content": self.system}] if self.system is not None else []
        return self._render([*system, {"role": "user", "content": observation}], True)

    def first(self, observation: str) -> list[int]:
        return self._encode(self.first_text(observation))

    def next(self, observation: str, stopped_on: int | None) -> list[int]:
        """The tokens after an action that ended on ``stopped_on``: the template's close of the assistant
        turn (less its first token when the model generated that very token), the user turn holding
        ``observation``, the next generation prompt."""
        messages = [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": ACTION},
            {"role": "user", "content": observation},
        ]
        ids = self._encode(self._render(messages, True).split(ACTION, 1)[1])
        closed = bool(ids) and stopped_on in self.stop_ids and ids[0] == stopped_on
        return ids[1:] if closed else ids

    def text(self, action) -> str:
        """An action's text as the environment reads it (special tokens left out; its answer alone where an
        ``answer`` pattern is given)."""
        text = self.tokenizer.decode(list(action), skip_special_tokens=True)
        if self.answer is None:
            return text
        found = list(self.answer.finditer(text))
        return "" if not found else ((found[-1].group(1) or "") if self.answer.groups else found[-1].group(0))
