"""The tool loop every LLM role with tools runs (the implementer, the judge's review): the model calls
tools until it calls ``finish`` with an answer that validates and that ``on_finish`` accepts.

The loop recovers instead of ending the attempt: a bad call (unknown tool, arguments that do not
validate) comes back as a tool error, a turn with no tool call gets a nudge, a reply cut at the output
limit is reported and not run, a ``finish`` that ``on_finish`` refuses (failing checks) goes back with
the reasons. It stops with a reason when the model is stuck (the same call over and over, or nudges
in a row) or out of turns. Old tool results are masked past a character budget so a long attempt
keeps fitting its context window; the newest stay whole. They are masked a chunk at a time, so the
conversation's start stays the same turn after turn between chunks and a provider's prompt cache
reads it (Anthropic's, marked in ``client.py``; OpenAI's, by itself).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from pydantic import BaseModel, ValidationError

from agents.llm.client import AssistantTurn, ChatClient, ToolCall, ToolSpec
from agents.roles import AgentError

FINISH = "finish"
RESULT_BUDGET = 60_000  # characters of tool results kept whole; older ones are masked
REPEATS_TO_STOP = 3  # the same call (name and arguments) this many times in a row: stuck
MEASURING = ("run_checks", "run_benchmark")  # repeating these is how a model compares figures: never stuck
NUDGES_TO_STOP = 3  # this many turns in a row without a tool call: stuck
CUTS_TO_STOP = 3  # this many replies in a row cut at the output limit: stuck (the limit is too small for it)
MASKED = "[an older tool result, masked to save context: call the tool again if you need it]"


class StuckError(AgentError):
    """The model repeats itself without progress (the same call, or no call at all, turn after turn),
    or runs out of turns."""


@dataclass
class LoopResult:
    output: BaseModel
    turns: int
    messages: list[dict] = field(default_factory=list)


def last_json_object(text: str) -> dict:
    """The last balanced ``{...}`` in ``text`` that parses as a JSON object: prose, code fences and
    braces before it do not matter (a greedy match across the whole reply would)."""
    decoder = json.JSONDecoder()
    found, start = None, text.find("{")
    while start != -1:
        try:
            value, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            start = text.find("{", start + 1)
            continue
        found = value  # a whole object: the search goes on after it, never inside it
        start = text.find("{", end)
    if found is None:
        raise ValueError("no JSON object in the answer")
    return found


def parse_answer(text: str, schema: type[BaseModel]) -> BaseModel:
    """The answer in ``text``: its last JSON object, validated against ``schema``."""
    return schema.model_validate(last_json_object(text))


def cut_note(turn: AssistantTurn) -> str:
    """What the model is told when its reply stopped at the output limit (``turn.cut_at``): the reply
    was not used, its tool calls (whose arguments may be incomplete) were not run."""
    calls = ", ".join(c.name for c in turn.tool_calls)
    dropped = f" Its tool calls ({calls}) were not run: their arguments may be incomplete." if calls else ""
    return (
        f"Your reply was cut at the output limit of {turn.cut_at} tokens, so it was not used.{dropped} "
        "Go on in smaller pieces: less text per reply, large files written as several edits, and a short "
        "final answer."
    )


def masked(messages: list[dict], budget: int = RESULT_BUDGET) -> list[dict]:
    """``messages`` with the oldest tool results replaced by a short note, so that those kept whole
    hold at most ``budget`` characters (the message structure stays: each call keeps its result). The
    masked ones cover whole chunks of half the budget, oldest first: which are masked changes only when
    the results grow by another chunk, not every turn (masking one more each turn rewrote the
    conversation's start every turn, and no prompt cache could read it). The last turn's results are
    never masked, however long (a failing check's report, which ``finish`` sends back whole)."""
    results = [index for index, message in enumerate(messages) if message["role"] == "tool"]
    total = sum(len(messages[index]["content"]) for index in results)
    chunk = max(1, budget // 2)
    to_mask = max(0, -(-(total - budget) // chunk)) * chunk  # characters, rounded up to whole chunks
    last_turn = max((index for index, message in enumerate(messages) if message["role"] == "assistant"), default=-1)
    out, covered = list(messages), 0
    for index in results:
        if covered >= to_mask or index > last_turn:
            break
        covered += len(messages[index]["content"])
        out[index] = {**messages[index], "content": MASKED}
    return out


def finish_spec(schema: type[BaseModel], description: str) -> ToolSpec:
    return ToolSpec(FINISH, description, schema.model_json_schema())


def run_loop(
    client: ChatClient,
    system: str,
    messages: list[dict],
    toolbox,
    schema: type[BaseModel],
    *,
    finish_description: str,
    on_finish: Callable[[BaseModel], str | None] | None = None,
    max_turns: int = 40,
    role: str = "agent",
) -> LoopResult:
    """Run the model with ``toolbox``'s tools and a ``finish`` tool taking ``schema`` until it
    finishes. ``on_finish(output)`` returns None to accept, or the problems that send the model back
    to work (within ``max_turns``). A reply of only text whose last JSON object validates against
    ``schema`` counts as a ``finish`` call (models that answer in text instead of calling it)."""
    messages = list(messages)
    specs = toolbox.specs() + [finish_spec(schema, finish_description)]
    recent: list[tuple[str, str]] = []
    nudges = cuts = 0
    for turn_number in range(1, max_turns + 1):
        left = max_turns - turn_number
        turn = client.chat(system, masked(messages), specs)
        cuts = cuts + 1 if turn.cut_at is not None else 0
        if cuts >= CUTS_TO_STOP:  # a reasoning model can spend the whole limit thinking, every turn
            raise StuckError(
                f"the {role}'s replies were cut at the output limit of {turn.cut_at} tokens {cuts} turns in a row "
                "(raise it with --max-output-tokens)"
            )
        if turn.cut_at is not None:  # never an answer, and its calls are not run: the model is told
            messages.append({"role": "assistant", "text": turn.text, "tool_calls": []})
            messages.append({"role": "user", "content": cut_note(turn)})
            continue
        calls = turn.tool_calls
        if not calls:
            try:
                output = parse_answer(turn.text, schema)
            except (ValueError, ValidationError):
                output = None
            if output is not None:  # a text answer: treated as the finish call it stands for
                calls = [ToolCall(f"text-answer-{turn_number}", FINISH, json.dumps(output.model_dump()))]
                turn = AssistantTurn(turn.text, calls, turn.input_tokens, turn.output_tokens)
        messages.append({"role": "assistant", "text": turn.text, "tool_calls": calls})
        if not calls:
            nudges += 1
            if nudges >= NUDGES_TO_STOP:
                raise StuckError(f"the {role} answered {nudges} turns in a row without a tool call or a finish")
            messages.append(
                {
                    "role": "user",
                    "content": f"No tool was called. Go on with a tool, or call {FINISH} when the work is done "
                    f"({left} turns left).",
                }
            )
            continue
        nudges = 0
        for call in calls:
            key = (call.name, call.arguments)
            recent = [*recent, key][-REPEATS_TO_STOP:]
            if call.name not in (FINISH, *MEASURING) and len(recent) == REPEATS_TO_STOP and len(set(recent)) == 1:
                raise StuckError(
                    f"the {role} called {call.name} with the same arguments {REPEATS_TO_STOP} times in a row "
                    f"({call.arguments[:120]})"
                )
            if call.name == FINISH:
                result, output = _finish(call, schema, on_finish)
            else:
                result, output = toolbox.call(call), None
            if left <= 5:
                result += f"\n[{left} turns left: finish soon]"
            messages.append({"role": "tool", "tool_call_id": call.id, "name": call.name, "content": result})
            if output is not None:
                return LoopResult(output, turn_number, messages)
    raise StuckError(f"the {role} used its {max_turns} turns without finishing")


def _finish(call: ToolCall, schema: type[BaseModel], on_finish) -> tuple[str, BaseModel | None]:
    """The result of a ``finish`` call and the accepted answer (None: the model goes on)."""
    try:
        output = schema.model_validate(json.loads(call.arguments or "{}"))
    except (json.JSONDecodeError, ValidationError) as error:
        return f"error: {FINISH} was called with invalid arguments: {error}", None
    problems = on_finish(output) if on_finish is not None else None
    if problems:
        return f"Not finished yet:\n{problems}\nFix this, then call {FINISH} again.", None
    return "finished", output
