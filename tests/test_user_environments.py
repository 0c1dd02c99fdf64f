"""A user's own environment, plugged in by import path (``workload.environment.entry``) through an
adapter: its text rendered with the model's chat template, its reward the reward, every reset and
step in the harness's trace; a bad entry is a clear error that names it, never a traceback."""

from __future__ import annotations

import asyncio
import os
import random
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from orchestrator.cli import app
from orchestrator.history import History
from orchestrator.state import RunState
from skills.starter import write_starter
from targets.harness.clock import WallClock
from targets.harness.environments import EnvironmentPool
from targets.harness.environments.adapters import UserEnvironmentError
from targets.harness.environments.hosted import Confinement
from targets.harness.isolation import sandbox as sandbox_module
from targets.harness.isolation.launch import Limits, run_harness
from targets.harness.isolation.sandbox import Sandbox
from targets.harness.model import load_tokenizer, model_dir
from targets.harness.target import Target, TargetUnavailable, resolve_execution
from targets.harness.trace import Trace
from targets.spec import SpecError, load_target, parse_target

PACKAGE = '''
import asyncio
import itertools
import os
import random
import re
import sys
import threading
import time

from targets.api import TextStep

LEDGER = os.path.join(os.path.dirname(__file__), "ledger.txt")  # each instance made, and each close()
NUMBERS = itertools.count()


def _note(what, name, *more):
    with open(LEDGER, "a") as ledger:
        ledger.write(" ".join(map(str, (what, name, *more))) + "\\n")


class HiddenNumber:
    """gymnasium-style: find a number from 1 to ``high``; the answer's first number counts."""

    def __init__(self, high: int = 3):
        self.high = high
        self.name = f"{os.getpid()}-{next(NUMBERS)}"
        _note("made", self.name, threading.get_ident())

    def close(self):
        _note("closed", self.name)

    def reset(self, seed=None):
        self.seed, self.secret = seed, random.Random(seed).randint(1, self.high)
        _note("reset", self.name, seed, threading.get_ident())
        return f"Guess a number from 1 to {self.high}.", {"secret": self.secret}

    def step(self, action):
        found = re.findall(r"\\d+", action)
        if found and int(found[0]) == self.secret:
            return "Correct!", 1.0, True, False, {}
        hint = ("Higher." if int(found[0]) < self.secret else "Lower.") if found else "A number."
        return hint, 0.0, False, False, {}


class Echo:
    """A text environment of its own (async): the reward is how many times the action says 'echo'."""

    def __init__(self, word: str = "echo"):
        self.word = word

    async def reset(self, task):
        self.task = task
        return f"Task {task}: say {self.word}."

    async def step(self, action):
        return TextStep(f"You said {action!r}.", float(action.count(self.word)), True)


class SlowToAnswer(HiddenNumber):
    """Its steps take a moment (a tool call): one may be under way when the run ends."""

    def step(self, action):
        time.sleep(0.3)
        return super().step(action)


class SlowThenCloses(HiddenNumber):
    """Its steps take 0.6 s (a tool's slow answer); it notes its close as HiddenNumber does."""

    def step(self, action):
        time.sleep(0.6)
        return super().step(action)


class CleansUpSlowly(Echo):
    """An async text environment whose step waits on a tool for ever and, cancelled, takes a moment to let
    its connection go; its close notes whether that cleanup was over."""

    async def step(self, action):
        self.name, self.cleaned = f"{os.getpid()}-{next(NUMBERS)}", False
        try:
            await asyncio.sleep(60)
        finally:
            await asyncio.sleep(0.2)
            self.cleaned = True

    async def close(self):
        _note("closed" if self.cleaned else "closed-during-cleanup", self.name)


class ClosesBadly(HiddenNumber):
    """Its close() raises (a subprocess it holds is already gone)."""

    def close(self):
        raise ProcessLookupError("no such process")


class Breaks:
    """Raises at its second step (the user's bug)."""

    def reset(self, seed=None):
        self.turn = 0
        return "Begin.", {}

    def step(self, action):
        self.turn += 1
        _note("stepped", f"turn-{self.turn}")
        if self.turn == 2:
            self.fail()
        return "Go on.", 0.0, False, False, {}

    def fail(self):
        raise KeyError("lost the board")


class Hangs(Breaks):
    """Its second step never returns in time (a tool waiting on a dead socket)."""

    def fail(self):
        time.sleep(3)


class Exhausted(Breaks):
    """Calls next() on an empty iterator: a StopIteration, which no future can hold."""

    def fail(self):
        next(iter(()))


class TimesOut(Breaks):
    """Its own tool call times out at once: the user's TimeoutError, not a hang."""

    def fail(self):
        raise TimeoutError("the tool's socket timed out")


class BreaksOnceFlagged(HiddenNumber):
    """Steps as HiddenNumber until a file appears, then raises (a service it calls went away mid-run)."""

    def __init__(self, flag: str, high: int = 3):
        super().__init__(high)
        self.flag = flag

    def step(self, action):
        if os.path.exists(self.flag):
            raise ConnectionError("the game server went away")
        return super().step(action)


class Tasks(list):
    """A verifiable task set, as reasoning-gym's datasets are."""

    def score_answer(self, answer, entry):
        return 1.0 if answer.strip() == entry["answer"] else 0.0


def tasks(size: int = 3):
    return Tasks({"question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(size))


class Sized(Tasks):
    """A task set whose length is its config's size, as reasoning-gym's: a negative size fails in len()."""

    def __init__(self, size: int) -> None:
        super().__init__(tasks(3))
        self.size = size

    def __len__(self):
        return self.size


def sized(size: int = 3):
    return Sized(size)


class Unscored(Tasks):
    """A task set whose scorer forgot its return: every answer scored None."""

    def score_answer(self, answer, entry):
        answer.strip() == entry["answer"]


def unscored():
    return Unscored(tasks())


class Quits(Echo):
    """An async text environment whose step calls sys.exit() (a tool's error path that exits)."""

    async def step(self, action):
        sys.exit(3)


class Mumbles:
    """A text environment whose step answers with a tuple, not a TextStep."""

    async def reset(self, task):
        await asyncio.sleep(0.01)  # as a remote environment would take its time
        return "Go."

    async def step(self, action):
        return ("ok", 1.0, True)


class Answers:
    """A text environment whose step answers with what it was made with (a user's slip in one field)."""

    def __init__(self, observation="ok", reward=1.0, done=True, truncated=False):
        self.answer = TextStep(observation, reward, done, truncated)

    async def reset(self, task):
        return "Go."

    async def step(self, action):
        return self.answer


class Impatient(HiddenNumber):
    """gymnasium-style with a time limit of its own (gymnasium's TimeLimit): after ``limit`` steps a wrong
    guess is truncated, not terminated."""

    def __init__(self, high: int = 3, limit: int = 1):
        super().__init__(high)
        self.limit, self.steps = limit, 0

    def step(self, action):
        self.steps += 1
        observation, reward, terminated, _, info = super().step(action)
        return observation, reward, terminated, self.steps >= self.limit and not terminated, info


class TextFlags(HiddenNumber):
    """gymnasium-style, its terminated and truncated flags as given (a text "False", a None: a user's slip)."""

    def __init__(self, terminated="False", truncated=False):
        super().__init__()
        self.flags = (terminated, truncated)

    def step(self, action):
        observation, reward, _, _, info = super().step(action)
        return observation, reward, *self.flags, info


class SyncClose(Answers):
    """A text environment whose close() is a plain function."""

    def close(self):
        pass


def never_made(**params):
    """A factory that never returns."""
    threading.Event().wait()


def exits(**params):
    """A factory that ends the process."""
    sys.exit(3)


class OldGym(HiddenNumber):
    """The old gym API: step answers (observation, reward, done, info)."""

    def step(self, action):
        observation, reward, terminated, _, info = super().step(action)
        return observation, reward, terminated, info


class Renders(HiddenNumber):
    """gymnasium-style, but its observations are no text: a board as a dict, or nothing at all."""

    def __init__(self, reset_to=None, step_to=None):
        super().__init__()
        self.reset_to, self.step_to = reset_to, step_to

    def reset(self, seed=None):
        super().reset(seed)
        return self.reset_to, {}

    def step(self, action):
        return self.step_to, 0.0, False, False, {}


class KeepsItsThread(HiddenNumber):
    """Holds a sqlite connection, which only the thread that made it may use (a sync Playwright is alike)."""

    def __init__(self, high: int = 3):
        import sqlite3

        super().__init__(high)
        self.db = sqlite3.connect(":memory:")

    def reset(self, seed=None):
        self.db.execute("select 1")
        return super().reset(seed)

    def step(self, action):
        self.db.execute("select 1")
        return super().step(action)

    def close(self):
        self.db.close()
        super().close()


class FirstCloseFails(HiddenNumber):
    """The first of its instances to close raises; the others close."""

    FAILED = []

    def close(self):
        if not FirstCloseFails.FAILED:
            FirstCloseFails.FAILED.append(self.name)
            _note("close-failed", self.name)
            raise ProcessLookupError("no such process")
        super().close()


class EndsSilently(HiddenNumber):
    """Its terminating step answers with no observation."""

    def step(self, action):
        return None, 1.0, True, False, {}


class Wordy(HiddenNumber):
    """Its first observation alone fills the model's context."""

    def reset(self, seed=None):
        super().reset(seed)
        return "word " * 400, {}


class Picked(Tasks):
    def __getitem__(self, index):
        _note("picked-in", threading.current_thread().name)
        return super().__getitem__(index)


def picked():
    return Picked(tasks())


class NanScored(Tasks):
    def score_answer(self, answer, entry):
        return float("nan")


def nan_scored():
    return NanScored(tasks())


class EvalScored(Tasks):
    """A task set whose scorer evaluates the answer as an expression (as a math scorer's sympy parse does)."""

    def score_answer(self, answer, entry):
        return eval(answer)


def eval_scored():
    return EvalScored(tasks())


def questionless():
    return Tasks([{"prompt": "What is 1 + 1?", "answer": "2"}])


NOT_CALLABLE = 3
'''


@pytest.fixture
def user_package(tmp_path, monkeypatch):
    (tmp_path / "my_envs.py").write_text(textwrap.dedent(PACKAGE))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_envs"


def _spec(catalog_yaml, environment: dict, **model):
    catalog_yaml["model"].update({"tokenizer": "bpe", **model})
    catalog_yaml["model"]["config"]["vocab_size"] = 320
    catalog_yaml["workload"].update(environment=environment, turns={"max": 3})
    return parse_target(catalog_yaml)


OPEN_POOLS: list[EnvironmentPool] = []  # each test's, closed when it ends (``_close_pools``)


@pytest.fixture(autouse=True)
def _close_pools():
    """The process each pool a test made runs its environments in, ended with the test, passed or failed."""
    yield
    while OPEN_POOLS:
        OPEN_POOLS.pop().close()


def _pool(spec):
    clock = WallClock()  # a user's environment takes its own time: nothing here sleeps
    trace = Trace(clock)
    pool = EnvironmentPool(spec.workload, clock, trace, seed=1, model_path=str(model_dir(spec.model)))
    OPEN_POOLS.append(pool)
    return pool, trace


def test_a_gymnasium_style_environment_speaks_through_the_chat_template(catalog_yaml, user_package, tmp_path):
    spec = _spec(catalog_yaml, {"entry": "my_envs:HiddenNumber", "adapter": "gymnasium", "params": {"high": 3}})
    pool, trace = _pool(spec)
    tokenizer = load_tokenizer(model_dir(spec.model))
    first, second = pool.new_group()[:2]
    prompt = asyncio.run(first.reset())
    assert (
        tokenizer.decode(prompt) == "<|im_start|>user\nGuess a number from 1 to 3.<|im_end|>\n<|im_start|>assistant\n"
    )
    asyncio.run(second.reset())
    # a group shares its task: the seed itself (two secrets of 1-3 agree by chance one time in three), as the
    # environments' own notes say (they run in a process of their own)
    other = pool.new_group()[0]
    asyncio.run(other.reset())
    seeds = [int(seed) for _, seed, _ in _notes(tmp_path, "reset")]
    assert seeds == [first.task, first.task, other.task] and other.task != first.task  # another group, another task
    secret = random.Random(first.task).randint(1, 3)
    wrong = 1 if secret != 1 else 2
    action = tokenizer.encode(f"It is {wrong}", add_special_tokens=False) + [tokenizer.eos_token_id]
    result = asyncio.run(first.step(action))
    hint = "Higher." if wrong < secret else "Lower."
    # the model's own stop token closed its turn: the observation does not repeat it
    assert tokenizer.decode(result.observation) == f"\n<|im_start|>user\n{hint}<|im_end|>\n<|im_start|>assistant\n"
    assert (result.reward, result.done) == (0.0, False)
    right = tokenizer.encode(str(secret), add_special_tokens=False)
    result = asyncio.run(first.step(right))
    assert (result.reward, result.done, result.observation) == (1.0, True, [])
    steps = [e for e in trace.events if e.kind == "env_step"]
    assert [(e.data["turn"], e.data["reward"], e.data["done"]) for e in steps] == [(1, 0.0, False), (2, 1.0, True)]
    assert [e.data["action"] for e in steps] == [action, right]


def test_a_gymnasium_truncation_ends_the_episode_and_is_recorded_apart_from_its_play(catalog_yaml, user_package):
    """gymnasium's ``truncated`` (a limit of the environment's own) was merged with ``terminated``: the trace
    said the play had ended the episode, and a workload profile counted its length as the environment's."""
    spec = _spec(catalog_yaml, {"entry": "my_envs:Impatient", "adapter": "gymnasium", "params": {"limit": 1}})
    pool, trace = _pool(spec)
    tokenizer = load_tokenizer(model_dir(spec.model))
    cut, solved = pool.new_group()[:2]
    asyncio.run(cut.reset())
    asyncio.run(solved.reset())
    secret = random.Random(cut.task).randint(1, 3)  # HiddenNumber's, from the task it was reset with
    wrong = tokenizer.encode(str(1 if secret != 1 else 2), add_special_tokens=False)
    assert asyncio.run(cut.step(wrong)).done
    assert asyncio.run(solved.step(tokenizer.encode(str(secret), add_special_tokens=False))).reward == 1.0
    steps = {e.data["episode"]: e.data for e in trace.events if e.kind == "env_step"}
    assert steps[cut.episode_id]["done"] and steps[cut.episode_id]["env_truncated"]
    assert steps[solved.episode_id]["done"] and not steps[solved.episode_id]["env_truncated"]
    assert not steps[cut.episode_id]["capped"]  # the harness's turn cap (3) did not end it


def test_a_text_environment_by_import_path_and_a_task_set(catalog_yaml, user_package):
    spec = _spec(catalog_yaml, {"entry": "my_envs:Echo", "adapter": "text", "params": {"word": "echo"}})
    pool, _ = _pool(spec)
    tokenizer = load_tokenizer(model_dir(spec.model))
    episode = pool.new_group()[0]
    assert tokenizer.decode(asyncio.run(episode.reset())).startswith(
        f"<|im_start|>user\nTask {episode.task}: say echo."
    )
    result = asyncio.run(episode.step(tokenizer.encode("echo, echo", add_special_tokens=False)))
    assert (result.reward, result.done) == (2.0, True)

    catalog_yaml["workload"]["environment"] = {"entry": "my_envs:tasks", "adapter": "tasks", "params": {"size": 3}}
    pool, _ = _pool(parse_target(catalog_yaml))
    episode = pool.new_group()[0]
    question = tokenizer.decode(asyncio.run(episode.reset()), skip_special_tokens=True)
    i = episode.task % 3
    assert f"What is {i} + {i}?" in question
    result = asyncio.run(episode.step(tokenizer.encode(str(2 * i), add_special_tokens=False)))
    assert (result.reward, result.done) == (1.0, True)


def test_a_task_set_reads_the_answer_its_system_message_asks_for(catalog_yaml, user_package):
    """A task set scored the whole response (reasoning-gym's partial credit paid any text holding the digits;
    a thinking model's reasoning was scored with its answer). ``system`` is told the model on each episode's
    first turn and ``answer`` names what the environment reads: the last match's group, "" where none."""
    environment = {"entry": "my_envs:tasks", "adapter": "tasks", "params": {"size": 3}}
    environment.update(system="Put the answer between <answer> and </answer>.", answer="<answer>(.*?)</answer>")
    spec = _spec(catalog_yaml, environment)
    pool, trace = _pool(spec)
    tokenizer = load_tokenizer(model_dir(spec.model))
    right, late, none = pool.new_group()[:1] + pool.new_group()[:1] + pool.new_group()[:1]
    for episode in (right, late, none):
        prompt = tokenizer.decode(asyncio.run(episode.reset()))
        assert prompt.startswith("<|im_start|>system\nPut the answer between <answer> and </answer>.<|im_end|>")
    said = {
        right: f"{2 * (right.task % 3)} is it, I think: <answer>{2 * (right.task % 3)}</answer>",
        late: f"<answer>{2 * (late.task % 3)}</answer>, no: <answer>{2 * (late.task % 3) + 1}</answer>",
        none: f"{2 * (none.task % 3)}",
    }
    rewards = {e: asyncio.run(e.step(tokenizer.encode(said[e], add_special_tokens=False))).reward for e in said}
    assert (rewards[right], rewards[late], rewards[none]) == (1.0, 0.0, 0.0)  # the last answer counts; none: ""


@pytest.mark.parametrize(
    ("environment", "message"),
    [
        ({"entry": "my_envs:tasks", "adapter": "tasks", "answer": "(a)(b)"}, "has 2 groups: give one"),
        ({"entry": "my_envs:tasks", "adapter": "tasks", "answer": "(unclosed"}, "is not a regular expression"),
        ({"name": "guess_number", "system": "Be brief."}, "system is for a user's entry"),
        ({"entry": "no_such_package.envs:Env", "adapter": "gymnasium"}, "no_such_package is not installed here"),
        ({"entry": "my_envs.nowhere:Env", "adapter": "gymnasium"}, "cannot import my_envs.nowhere"),
        ({"entry": "my_envs:Missing", "adapter": "gymnasium"}, "my_envs has no attribute Missing"),
        ({"entry": "my_envs:NOT_CALLABLE", "adapter": "gymnasium"}, "NOT_CALLABLE is not callable"),
        ({"entry": "my_envs", "adapter": "gymnasium"}, "write it as package.module:callable"),
        ({"entry": "my_envs:HiddenNumber"}, "say its adapter"),
        ({"name": "guess_number", "entry": "my_envs:HiddenNumber", "adapter": "gymnasium"}, "or bring your own"),
        ({"entry": "my_envs:HiddenNumber", "adapter": "docker"}, "adapter"),
        ({"entry": "my_envs:tasks", "adapter": "tasks", "writable": ["logs"]}, "give each folder as an absolute path"),
        ({"name": "guess_number", "writable": ["/tmp"]}, "writable is for a user's entry"),
    ],
    ids=[
        "answer of two groups",
        "answer no regex",
        "system for a harness environment",
        "missing package",
        "missing module",
        "missing attribute",
        "not callable",
        "no callable named",
        "no adapter",
        "both",
        "bad adapter",
        "writable relative",
        "writable for a harness environment",
    ],
)
def test_a_bad_entry_is_a_spec_error_naming_it(catalog_yaml, user_package, environment, message):
    with pytest.raises(SpecError, match="workload.environment") as caught:
        _spec(catalog_yaml, environment)
    assert message in str(caught.value)


def test_a_module_in_the_working_folder_but_not_importable_says_how_to_import_it(catalog_yaml, tmp_path, monkeypatch):
    """'my_env is not installed here' sent a user with my_env.py beside them to pip: the message says
    the working folder is not imported from, and how to put it on the path."""
    (tmp_path / "loose_env.py").write_text(textwrap.dedent(PACKAGE))
    monkeypatch.chdir(tmp_path)  # not on sys.path: a console script's path holds no working folder
    with pytest.raises(SpecError, match="loose_env.py is in the working folder") as caught:
        _spec(catalog_yaml, {"entry": "loose_env:HiddenNumber", "adapter": "gymnasium"})
    assert "PYTHONPATH=$PWD" in str(caught.value)
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = _spec(catalog_yaml, {"entry": "loose_env:HiddenNumber", "adapter": "gymnasium"})  # as the message says
    assert spec.workload.environment.entry == "loose_env:HiddenNumber"


@pytest.mark.parametrize(
    ("environment", "message"),
    [
        (
            {"entry": "my_envs:HiddenNumber", "adapter": "gymnasium", "params": {"size": 3}},
            "'my_envs:HiddenNumber' does not take params {'size': 3}",
        ),
        ({"entry": "my_envs:tasks", "adapter": "tasks", "params": {"size": 0}}, "made an empty task set"),
        ({"entry": "my_envs:sized", "adapter": "tasks", "params": {"size": -5}}, "whose len() fails"),
        ({"entry": "my_envs:Echo", "adapter": "gymnasium"}, "async reset/step: gymnasium's are plain calls"),
        ({"entry": "my_envs:HiddenNumber", "adapter": "text"}, "a text environment has async reset(task)"),
        ({"entry": "my_envs:tasks", "adapter": "gymnasium"}, "which has no reset, step"),
    ],
    ids=[
        "wrong params",
        "empty task set",
        "a failing len()",
        "async as gymnasium",
        "sync as text",
        "not an environment",
    ],
)
def test_an_entry_that_cannot_make_an_environment_is_named_when_the_run_makes_it(
    catalog_yaml, user_package, environment, message
):
    spec = _spec(catalog_yaml, environment)
    with pytest.raises(UserEnvironmentError, match="environment entry 'my_envs:") as caught:
        _pool(spec)
    assert message in str(caught.value)


def test_a_harness_command_names_an_environment_that_cannot_be_made_before_it_judges_anything(
    tmp_path, catalog_yaml, user_package
):
    """``check`` ran the accuracy checks first and then failed the system run with the environment's
    traceback, as the candidate's failure; every harness command now makes the user's environment first."""
    from orchestrator.cli.app import session

    spec = _spec(catalog_yaml, {"entry": "my_envs:sized", "adapter": "tasks", "params": {"size": -5}})
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec.model_dump(mode="json", exclude_none=True)))
    with pytest.raises(UserEnvironmentError, match="'my_envs:sized' made a task set whose len\\(\\) fails"):
        session(str(path), "subprocess", None)


def test_an_answer_that_is_not_a_text_step_and_a_step_during_the_reset_are_named(catalog_yaml, user_package):
    spec = _spec(catalog_yaml, {"entry": "my_envs:Mumbles", "adapter": "text"})
    pool, _ = _pool(spec)
    episode, other = pool.new_group()[:2]
    asyncio.run(episode.reset())
    with pytest.raises(UserEnvironmentError, match="answered a step of g0/e0 with a tuple, not a targets.api.TextStep"):
        asyncio.run(episode.step([5]))

    async def step_while_resetting():
        resetting = asyncio.ensure_future(other.reset())
        await asyncio.sleep(0)  # the reset has started and awaits the environment
        try:
            await other.step([5])
        finally:
            await resetting

    with pytest.raises(RuntimeError, match="stepped while its previous step was still running"):
        asyncio.run(step_while_resetting())


def test_a_plain_close_and_a_factory_that_never_returns_are_named_by_the_check(catalog_yaml, user_package, monkeypatch):
    """A text environment's close() that is no coroutine was called "raised: a coroutine was expected" (it
    raised nothing); a factory that never returned held `target validate` and `generate` forever."""
    from targets.harness.environments import hosted

    plain = _spec(catalog_yaml, {"entry": "my_envs:SyncClose", "adapter": "text"}).workload.environment
    with pytest.raises(UserEnvironmentError, match="made a SyncClose whose close\\(\\) is not async"):
        hosted.check_environment(plain)
    # one that calls sys.exit: `target validate` ended with its code and no word
    exits = _spec(catalog_yaml, {"entry": "my_envs:exits", "adapter": "gymnasium"}).workload.environment
    with pytest.raises(UserEnvironmentError, match=r"my_envs:exits: called sys.exit\(3\) when made or closed"):
        hosted.check_environment(exits)
    # last: the short limit covers the host's start too (a loaded machine took longer to start one than this)
    monkeypatch.setattr(hosted, "CHECK_LIMIT_S", 0.5)
    hung = _spec(catalog_yaml, {"entry": "my_envs:never_made", "adapter": "gymnasium"}).workload.environment
    with pytest.raises(UserEnvironmentError, match="making one and closing it did not finish within 0.5 s"):
        hosted.check_environment(hung)


def test_a_chat_template_that_does_not_render_is_named_before_any_episode(catalog_yaml, user_package):
    """A template with a jinja slip was a TemplateSyntaxError traceback in the first episode; one that leaves
    out the assistant's turn an IndexError. Both are named, with the model, as the format is made."""
    from targets.harness.environments.chat_format import ChatFormat, ChatTemplateError

    tokenizer = load_tokenizer(model_dir(_spec(catalog_yaml, {"entry": "my_envs:Answers", "adapter": "text"}).model))
    assert "probe-42" in ChatFormat(tokenizer, ()).first_text("probe-42")  # the model's own template renders
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }"
    with pytest.raises(ChatTemplateError, match="does not render a conversation \\(TemplateSyntaxError"):
        ChatFormat(tokenizer, ())
    tokenizer.chat_template = "{% for m in messages if m['role'] == 'user' %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ChatTemplateError, match="the chat template leaves out the assistant's turns"):
        ChatFormat(tokenizer, ())


def test_a_module_that_raises_as_it_imports_is_named(catalog_yaml, user_package, tmp_path):
    (tmp_path / "broken_envs.py").write_text("this is not python\n")
    with pytest.raises(SpecError, match=r"cannot import broken_envs \(NameError: name 'this' is not defined"):
        _spec(catalog_yaml, {"entry": "broken_envs:Env", "adapter": "gymnasium"})


def test_an_environment_that_raises_is_named_with_its_episode_and_turn(catalog_yaml, user_package):
    spec = _spec(catalog_yaml, {"entry": "my_envs:Breaks", "adapter": "gymnasium"})
    pool, _ = _pool(spec)
    episode = pool.new_group()[0]
    asyncio.run(episode.reset())
    asyncio.run(episode.step([5, 6]))
    with pytest.raises(UserEnvironmentError, match="environment my_envs:Breaks raised KeyError at turn 2 of g0/e0"):
        asyncio.run(episode.step([5, 6]))


def test_a_task_set_scoring_no_number_is_named_not_read_as_a_zero_reward(catalog_yaml, user_package):
    spec = _spec(catalog_yaml, {"entry": "my_envs:unscored", "adapter": "tasks"})
    pool, _ = _pool(spec)
    episode = pool.new_group()[0]
    asyncio.run(episode.reset())
    with pytest.raises(UserEnvironmentError, match="my_envs:unscored at turn 1 of g0/e0: score_answer returned None"):
        asyncio.run(episode.step([5, 6]))


@pytest.mark.parametrize(
    ("environment", "message"),
    [
        ({"entry": "my_envs:Answers", "params": {"reward": float("nan")}}, "reward nan, not a finite number"),
        ({"entry": "my_envs:Answers", "params": {"reward": float("-inf")}}, "reward -inf, not a finite number"),
        ({"entry": "my_envs:Answers", "params": {"reward": None}}, "reward None, not a finite number"),
        ({"entry": "my_envs:Answers", "params": {"reward": "1"}}, "reward '1', not a finite number"),
        ({"entry": "my_envs:Answers", "params": {"observation": None, "done": False}}, "observation None, not a str"),
        ({"entry": "my_envs:Answers", "params": {"done": 1}}, "done 1, not a bool"),
        ({"entry": "my_envs:Answers", "params": {"done": 1, "observation": None}}, "done 1, not a bool"),
        ({"entry": "my_envs:Answers", "params": {"truncated": None}}, "truncated None, not a bool"),
        (
            {"entry": "my_envs:Answers", "params": {"done": False, "truncated": True}},
            "truncated True with done False: a truncated episode has ended",
        ),
        ({"entry": "my_envs:nan_scored", "adapter": "tasks"}, "reward nan, not a finite number"),
        ({"entry": "my_envs:OldGym", "adapter": "gymnasium"}, "a 4-tuple (the old gym API"),
        ({"entry": "my_envs:TextFlags", "adapter": "gymnasium"}, "terminated 'False', not a bool"),
        (
            {"entry": "my_envs:TextFlags", "adapter": "gymnasium", "params": {"terminated": False, "truncated": None}},
            "truncated None, not a bool",
        ),
    ],
    ids=[
        "nan",
        "inf",
        "none",
        "text reward",
        "no observation",
        "int done",
        "int done first",
        "none truncated",
        "truncated going on",
        "nan score",
        "old gym",
        "text terminated",
        "none truncated gymnasium",
    ],
)
def test_a_step_answer_a_run_cannot_train_on_is_named_by_its_field(catalog_yaml, user_package, environment, message):
    """A NaN reward would reach the candidate's loss as a null, a None one the harness's sum as a
    TypeError: every adapter's answer is checked, field by field, and the error names the turn."""
    spec = _spec(catalog_yaml, {"adapter": "text", **environment})
    episode = _pool(spec)[0].new_group()[0]
    asyncio.run(episode.reset())
    with pytest.raises(UserEnvironmentError, match=f"{environment['entry']} .*turn 1 of g0/e0") as caught:
        asyncio.run(episode.step([5, 6]))
    assert message in str(caught.value)


@pytest.mark.parametrize(
    ("params", "when", "message"),
    [
        ({"reset_to": None}, "reset", "began g0/e0 with observation None, a NoneType, not a str"),
        ({"reset_to": {"board": [1, 2]}}, "reset", "with observation {'board': [1, 2]}, a dict, not a str"),
        ({"reset_to": "Move.", "step_to": b"hi"}, "step", "observation b'hi', not a str"),
    ],
    ids=["reset None", "reset dict", "step bytes"],
)
def test_an_observation_that_is_no_text_is_named_never_turned_into_its_repr(
    catalog_yaml, user_package, params, when, message
):
    """The adapters took str() of whatever came: the model trained on 'None' or a dict's repr as its prompt."""
    spec = _spec(catalog_yaml, {"entry": "my_envs:Renders", "adapter": "gymnasium", "params": params})
    episode = _pool(spec)[0].new_group()[0]
    with pytest.raises(UserEnvironmentError, match="my_envs:Renders") as caught:
        asyncio.run(episode.reset())
        assert when == "step", "the reset was not refused"
        asyncio.run(episode.step([5, 6]))
    assert message in str(caught.value)


def test_a_gymnasium_environment_lives_on_the_thread_that_made_it(catalog_yaml, user_package, tmp_path):
    """Every call ran on a fresh thread (and the first episode's environment was made on the harness's):
    an environment bound to its thread (sqlite, a sync Playwright) failed its first reset."""
    spec = _spec(catalog_yaml, {"entry": "my_envs:KeepsItsThread", "adapter": "gymnasium"})
    first, second = _pool(spec)[0].new_group()[:2]  # the first's environment is the one made to check the entry

    async def play() -> None:
        for episode in (first, second):
            await episode.reset()
            await episode.step([5, 6])
            await episode.close()

    asyncio.run(play())
    made, reset = dict(_notes(tmp_path, "made")), {name: thread for name, _, thread in _notes(tmp_path, "reset")}
    assert len(reset) == 2 and all(reset[name] == made[name] for name in reset)  # each on the thread that made it


def test_a_last_observation_that_is_no_text_is_never_read_so_never_refused(catalog_yaml, user_package):
    """An environment may answer its terminating step with no observation (None): nothing reads it."""
    spec = _spec(catalog_yaml, {"entry": "my_envs:EndsSilently", "adapter": "gymnasium"})
    episode = _pool(spec)[0].new_group()[0]
    asyncio.run(episode.reset())
    result = asyncio.run(episode.step([5, 6]))
    assert result.done and result.observation == [] and result.reward == 1.0


def test_a_first_observation_past_the_context_and_a_task_with_no_question_are_named(catalog_yaml, user_package):
    spec = _spec(catalog_yaml, {"entry": "my_envs:Wordy", "adapter": "gymnasium"})
    episode = _pool(spec)[0].new_group()[0]
    with pytest.raises(UserEnvironmentError, match=r"began g0/e0 with \d+ tokens: .*max_sequence 256"):
        asyncio.run(episode.reset())
    spec = _spec(catalog_yaml, {"entry": "my_envs:questionless", "adapter": "tasks"})
    episode = _pool(spec)[0].new_group()[0]
    with pytest.raises(UserEnvironmentError, match="my_envs:questionless resetting g0/e0: task 0 is a dict with no"):
        asyncio.run(episode.reset())


def test_a_task_set_is_indexed_in_a_thread_never_on_the_harness_loop(catalog_yaml, user_package, tmp_path):
    """A set may make each task as it is indexed: a slow one must not stall the harness's clock."""
    spec = _spec(catalog_yaml, {"entry": "my_envs:picked", "adapter": "tasks"})
    episode = _pool(spec)[0].new_group()[0]
    asyncio.run(episode.reset())
    assert _notes(tmp_path, "picked-in") == [["user-environment"]]


def test_an_environment_is_closed_once_and_a_close_that_raises_is_named(catalog_yaml, user_package, tmp_path):
    spec = _spec(catalog_yaml, {"entry": "my_envs:HiddenNumber", "adapter": "gymnasium"})
    pool, _ = _pool(spec)
    episode = pool.new_group()[0]
    asyncio.run(episode.reset())
    asyncio.run(episode.close())
    asyncio.run(episode.close())  # the run's end closing what an ended episode already closed
    made, closed = _ledger(tmp_path)
    assert len(made) == 1 and closed == made  # the one environment made, closed once
    spec = _spec(catalog_yaml, {"entry": "my_envs:ClosesBadly", "adapter": "gymnasium"})
    episode = _pool(spec)[0].new_group()[0]
    with pytest.raises(UserEnvironmentError, match="ClosesBadly raised ProcessLookupError closing g0/e0: no such"):
        asyncio.run(episode.close())


def test_an_environment_whose_step_the_run_end_cut_off_is_closed_once_that_step_answers(
    catalog_yaml, user_package, tmp_path
):
    """The run's end cancels the calls under way; a gymnasium environment's step goes on in its thread, so
    its close waits for that step to answer (it was skipped, and the environment left open)."""
    spec = _spec(catalog_yaml, {"entry": "my_envs:SlowToAnswer", "adapter": "gymnasium"})
    episode = _pool(spec)[0].new_group()[0]

    async def cut_off() -> None:
        await episode.reset()
        step = asyncio.ensure_future(episode.step([5, 6]))
        await asyncio.sleep(0.05)  # under way in its thread
        step.cancel()
        await asyncio.gather(step, return_exceptions=True)
        await episode.close()

    asyncio.run(cut_off())
    made, closed = _ledger(tmp_path)
    assert len(made) == 1 and closed == made


def test_the_reference_loop_closes_every_environment_it_made(catalog_yaml, user_package, tmp_path):
    """`vibetrain reference` never closed a user's environments: a subprocess or a sandbox each held
    leaked with every episode of every step."""
    from targets.harness.reference.loop import run_reference

    spec = _spec(catalog_yaml, {"entry": "my_envs:HiddenNumber", "adapter": "gymnasium"})
    folder = tmp_path  # where the package the environments' process imports writes
    before = set(_ledger(folder)[0])  # made as the spec was checked
    run_reference(spec, steps=1, seed=0)
    made, closed = _ledger(folder)
    assert len(set(made) - before) >= spec.workload.batch_size - 1, made  # the pool's check made the first
    assert set(made) - before <= set(closed) and set(closed.values()) == {1}, (made, closed)
    # one close that raises is said, after every other environment is closed
    spec = _spec(catalog_yaml, {"entry": "my_envs:FirstCloseFails", "adapter": "gymnasium"})
    before = set(_ledger(folder)[0])
    with pytest.raises(UserEnvironmentError, match="FirstCloseFails raised ProcessLookupError closing"):
        run_reference(spec, steps=1, seed=0)
    made, closed = _ledger(folder)
    failed = {name for name, *_ in _notes(folder, "close-failed")}
    assert set(made) - before - failed <= set(closed) and failed and not failed & set(closed)


def test_a_sys_exit_in_an_async_environment_is_named_and_never_stops_the_harness(catalog_yaml, user_package):
    spec = _spec(catalog_yaml, {"entry": "my_envs:Quits", "adapter": "text"})
    pool, _ = _pool(spec)
    episode = pool.new_group()[0]
    asyncio.run(episode.reset())
    named = "my_envs:Quits raised RuntimeError at turn 1 of g0/e0: SystemExit: 3"
    with pytest.raises(UserEnvironmentError, match=named):
        asyncio.run(episode.step([5, 6]))


def test_a_user_environment_needs_a_real_run_and_a_chat_tokenizer(catalog_yaml, user_package, tmp_path):
    environment = {"entry": "my_envs:HiddenNumber", "adapter": "gymnasium"}
    with pytest.raises(SpecError, match="speaks its own text: the model needs a tokenizer with a chat template"):
        _spec(catalog_yaml, environment, tokenizer=None)
    words_model = model_dir(load_target("tiny-qwen3-cpu").model)  # the word-level tokenizer has no chat template
    catalog_yaml["model"].update(
        weights=str(words_model), tokenizer=None, config=load_target("tiny-qwen3-cpu").model.config.model_dump()
    )
    catalog_yaml["workload"].update(environment=environment, turns={"max": 3})
    with pytest.raises(SpecError, match="a model directory whose tokenizer has one"):
        parse_target(catalog_yaml)
    catalog_yaml["model"]["weights"] = "random(0)"
    catalog_yaml["execution"] = "simulated"
    with pytest.raises(SpecError, match="runs for real"):
        _spec(catalog_yaml, environment)
    catalog_yaml.update(execution="auto", hardware={"kind": "h100", "count": 2})  # no GPU here: it would simulate
    with pytest.raises(TargetUnavailable, match="would be simulated as this machine has 0 of its 2 GPUs"):
        resolve_execution(_spec(catalog_yaml, environment))
    catalog_yaml["execution"] = "real"  # as the catalog's one-H100 arithmetic target says (it listed as auto)
    with pytest.raises(TargetUnavailable, match="this machine has 0: run it on a machine with them$"):
        resolve_execution(_spec(catalog_yaml, environment))  # never "or pass --simulate", which it refuses
    assert load_target("qwen3-0.6b-h100x1-arithmetic").execution == "real"
    catalog_yaml["hardware"] = {"kind": "cpu", "count": 2}
    catalog_yaml["execution"] = "real"
    path = tmp_path / "bad.yaml"
    catalog_yaml["workload"]["environment"] = {"entry": "my_envs:Nowhere", "adapter": "gymnasium"}
    path.write_text(yaml.safe_dump(catalog_yaml))
    result = CliRunner().invoke(app, ["target", "validate", str(path)])
    assert result.exit_code == 2 and "my_envs has no attribute Nowhere" in result.output
    assert "Traceback" not in result.output
    # validate makes one environment: params the entry refuses are named there, not 20 s into a check
    ledger = tmp_path  # where the package the check's process imports writes
    made_before, closed_before = (set(c) for c in _ledger(ledger))
    for params, said in (({"highest": 3}, "does not take params {'highest': 3}"), ({}, None)):
        catalog_yaml["workload"]["environment"] = {
            "entry": "my_envs:HiddenNumber",
            "adapter": "gymnasium",
            "params": params,
        }
        path.write_text(yaml.safe_dump(catalog_yaml))
        result = CliRunner().invoke(app, ["target", "validate", str(path)])
        assert (result.exit_code, said is None or said in result.output) == (2 if said else 0, True), result.output
    made, closed = _ledger(ledger)
    assert set(made) - made_before == set(closed) - closed_before != set()  # each one it made, closed
    catalog_yaml["workload"]["environment"] = {"entry": "my_envs:ClosesBadly", "adapter": "gymnasium"}
    path.write_text(yaml.safe_dump(catalog_yaml))
    result = CliRunner().invoke(app, ["target", "validate", str(path)])
    assert result.exit_code == 2 and "ClosesBadly: close() raised ProcessLookupError: no such" in result.output


def _user_target(fast_target, tmp_path, monkeypatch, entry: str, **params) -> Path:
    """The fast target with the user's environment, the package importable by the harness's own
    processes (never the candidate's), and two training steps: what is tested meets the environment
    in the first step's rollouts already."""
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}")
    data = yaml.safe_load(fast_target.read_text())
    data["model"]["tokenizer"] = "bpe"
    data["model"]["config"]["vocab_size"] = 320
    environment = {"entry": entry, "adapter": "gymnasium", **({"params": params} if params else {})}
    data["workload"].update(environment=environment, turns={"max": 3}, train_steps=2)
    data["workload"]["tokens"].update(prompt=24, observation=16)
    path = tmp_path / "target.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _real_run(fast_target, tmp_path, monkeypatch, entry: str, mode: str):
    """A real run of the time_multiplex starter on the fast target with the user's environment (the
    tests that call it join the test session's shared Ray cluster: conftest.py's ``shared_ray``)."""
    path = _user_target(fast_target, tmp_path, monkeypatch, entry)
    data = yaml.safe_load(path.read_text())
    stack = write_starter(tmp_path / "stack", parse_target(data), "time_multiplex")
    target = Target.load(path)
    return run_harness(target, stack, tmp_path / "out", mode, Limits(time_s=300), Sandbox("subprocess"))


@pytest.mark.slow
def test_a_real_run_on_a_user_environment_passes_check_with_its_rewards(
    fast_target, tmp_path, user_package, monkeypatch, shared_ray
):
    run = _real_run(fast_target, tmp_path, monkeypatch, "my_envs:HiddenNumber", "check")
    assert run.ok, run.cause
    assert all(c["passed"] for c in run.results["accuracy"]["checks"]), run.results["accuracy"]
    assert run.results["audit"]["result"]["passed"], run.results["audit"]["result"]["reasons"]
    steps = [e for e in Trace.load_events(run.out / "trace.jsonl") if e.kind == "env_step"]
    assert steps and {e.data["reward"] for e in steps} <= {0.0, 1.0} and max(e.data["turn"] for e in steps) <= 3
    made, closed = _ledger(tmp_path)
    assert len(made) >= len({e.data["episode"] for e in steps})  # one an episode (the system run's, and more)
    assert closed == made  # every environment the run made was closed once (ended, dropped or under way)


def _ledger(folder: Path) -> tuple[Counter, Counter]:
    """What the package's HiddenNumber wrote of the instances it made and those it closed."""
    lines = _notes(folder)
    return Counter(n[0] for what, *n in lines if what == "made"), Counter(
        n[0] for what, *n in lines if what == "closed"
    )


def _notes(folder: Path, what: str | None = None) -> list[list[str]]:
    """The package's notes (``_note``) in ``folder``'s ledger, as written (those of one kind: their words)."""
    path = folder / "ledger.txt"  # written by the process the environments ran in
    lines = [line.split() for line in path.read_text().splitlines()] if path.exists() else []  # none made yet
    return lines if what is None else [words for kind, *words in lines if kind == what]


def test_a_run_on_an_environment_that_cannot_be_made_is_refused_before_its_folder_is(
    fast_target, tmp_path, user_package, monkeypatch
):
    """generate made the run's folder and worktrees and ran round 0 before the environment was made (target
    validate would have said so in seconds): the same check now refuses the run before anything is written."""
    target = _user_target(fast_target, tmp_path, monkeypatch, "my_envs:HiddenNumber", size=3)
    run, workspaces = tmp_path / "run", tmp_path / "ws"
    args = ["generate", str(target), "--out", str(run), "--workspaces", str(workspaces), "--sandbox", "subprocess"]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    said = " ".join(result.output.split())
    assert result.exit_code == 2 and "'my_envs:HiddenNumber' does not take params {'size': 3}" in said, said
    assert not run.exists() and not workspaces.exists()


@pytest.mark.slow
def test_a_real_run_whose_environment_raises_fails_naming_it(
    fast_target, tmp_path, user_package, monkeypatch, shared_ray
):
    run = _real_run(fast_target, tmp_path, monkeypatch, "my_envs:Breaks", "measure")
    assert not run.ok
    assert "system run failed: UserEnvironmentError: environment my_envs:Breaks raised KeyError at turn 2" in run.cause
    assert "Traceback" not in run.cause


@pytest.mark.slow
def test_an_environment_that_fails_mid_run_stops_it_with_every_validated_round_kept(
    fast_target, tmp_path, user_package, monkeypatch, shared_ray
):
    flag = tmp_path / "server-gone"
    target = _user_target(fast_target, tmp_path, monkeypatch, "my_envs:BreaksOnceFlagged", flag=str(flag))
    run, workspaces = tmp_path / "run", tmp_path / "ws"
    args = ["generate", str(target), "--rounds", "1", "--repeat", "1", "--out", str(run), "--sandbox", "subprocess"]
    # round 1 must run for real to meet the broken server: the twin could screen it out unrun
    args += ["--workspaces", str(workspaces), "--no-prescreen"]
    committed = run / ".git" / "refs" / "vibetrain" / "rounds" / "0"
    watching = threading.Event()

    def break_after_round_0() -> None:  # round 1's system run starts seconds after round 0's commit
        while not watching.wait(0.05):
            if committed.exists():
                flag.touch()
                return

    watcher = threading.Thread(target=break_after_round_0, daemon=True)
    watcher.start()
    try:
        result = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    finally:
        watching.set()
    assert result.exit_code == 1, result.output
    assert "round 1 stopped: environment my_envs:BreaksOnceFlagged raised ConnectionError at turn" in result.output
    assert "not the candidate's" in result.output and "--resume" in result.output
    assert "Traceback" not in result.output
    state, history = RunState.load(run), History.open(run)
    assert [r.round for r in state.rounds] == [0] and state.next_round == 1  # round 1 is not held against anyone
    round_0 = history.round_commit(0)
    assert round_0 and state.best.commit == round_0 and history.rejected_commit(1) is None

    flag.unlink()  # the server is back
    result = CliRunner().invoke(app, [*args, "--resume"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    state = RunState.load(run)
    assert [r.round for r in state.rounds] == [0, 1] and state.record(1).verdict in ("accepted", "rejected")
    assert History.open(run).round_commit(0) == round_0


def test_the_ecosystems_own_environments_through_the_adapters(catalog_yaml):
    """GEM's Guess-the-Number (a gymnasium-style text game) and a reasoning-gym task set, offline,
    as a target names them (the ``envs`` extra installs both)."""
    pytest.importorskip("gem", reason="GEM comes with the envs extra: pip install -e '.[envs]'")
    pytest.importorskip("reasoning_gym", reason="reasoning-gym comes with the envs extra: pip install -e '.[envs]'")
    environment = {"entry": "gem:make", "adapter": "gymnasium", "params": {"env_id": "game:GuessTheNumber-v0-easy"}}
    catalog_yaml["workload"]["tokens"]["max_sequence"] = 1024  # its rules alone are some 330 tokens
    spec = _spec(catalog_yaml, environment)
    pool, trace = _pool(spec)
    tokenizer = load_tokenizer(model_dir(spec.model))
    episode = pool.new_group()[0]
    rules = tokenizer.decode(asyncio.run(episode.reset()), skip_special_tokens=True)
    assert "You are playing Guess The Number" in rules
    import gem

    secret = gem.make("game:GuessTheNumber-v0-easy")  # the same game, here: its number for the episode's task
    secret.reset(seed=episode.task)
    secret = secret.game_number
    result = asyncio.run(episode.step(tokenizer.encode(f"\\boxed{{{secret}}}", add_special_tokens=False)))
    assert result.done and result.reward > 0, result

    catalog_yaml["workload"]["environment"] = {
        "entry": "reasoning_gym:create_dataset",
        "adapter": "tasks",
        "params": {"name": "basic_arithmetic", "size": 8, "seed": 1},
    }
    pool, _ = _pool(parse_target(catalog_yaml))
    episode = pool.new_group()[0]
    asyncio.run(episode.reset())
    import reasoning_gym

    answer = reasoning_gym.create_dataset("basic_arithmetic", size=8, seed=1)[episode.task % 8]["answer"]
    result = asyncio.run(episode.step(tokenizer.encode(answer, add_special_tokens=False)))
    assert (result.reward, result.done) == (1.0, True)


def test_a_step_that_does_not_answer_in_time_times_the_episode_out(catalog_yaml, user_package):
    """As a built-in environment's slow step: the episode ends timed out, the call is abandoned."""
    catalog_yaml["workload"]["trajectory_timeout_s"] = 1.5  # reset and a first step take tens of ms
    spec = _spec(catalog_yaml, {"entry": "my_envs:Hangs", "adapter": "gymnasium"})
    pool, trace = _pool(spec)
    episode = pool.new_group()[0]
    asyncio.run(episode.reset())
    assert not asyncio.run(episode.step([5, 6])).done
    result = asyncio.run(episode.step([5, 6]))  # the environment sleeps 3 s: past the 1.5 s timeout
    assert result.done and result.timed_out and result.reward == 0.0
    last = [e for e in trace.events if e.kind == "env_step"][-1]
    # it waited out what was left of the trajectory's 1.5 s (its reset and first step had taken the rest)
    assert last.data["timed_out"] and last.t - episode.started_at > 1.5 and last.data["latency"] < 3

    spec = _spec(catalog_yaml, {"entry": "my_envs:TimesOut", "adapter": "gymnasium"})
    episode = _pool(spec)[0].new_group()[0]
    asyncio.run(episode.reset())
    asyncio.run(episode.step([5, 6]))
    with pytest.raises(UserEnvironmentError, match="my_envs:TimesOut raised TimeoutError at turn 2 of g0/e0"):
        asyncio.run(episode.step([5, 6]))  # its own timeout, at once: named as raised, not as a hang


def test_an_environment_whose_step_was_abandoned_is_closed_once_the_step_answers(catalog_yaml, user_package, tmp_path):
    """A step past the trajectory's time is abandoned (a thread cannot be stopped), and the episode's close
    returned at once: the environment was never closed, and what it holds (a container, a subprocess)
    leaked with every timeout (a review of user environments). Its close now waits on the environment's
    own thread behind the step, and runs once the step has answered."""
    catalog_yaml["workload"]["trajectory_timeout_s"] = 0.3
    spec = _spec(catalog_yaml, {"entry": "my_envs:SlowThenCloses", "adapter": "gymnasium"})
    episode = _pool(spec)[0].new_group()[0]

    folder = tmp_path  # where the package the environments' process imports writes

    async def main() -> str:
        await episode.reset()
        result = await episode.step([5, 6])
        assert result.timed_out and episode.abandoned is not None
        await episode.close()  # as the run closes every episode
        (name,) = _ledger(folder)[0]
        assert name not in _ledger(folder)[1]  # the step is still under way: nothing closed under it
        await asyncio.sleep(1.0)  # the step has answered (0.6 s) and the close has run behind it
        return name

    name = asyncio.run(main())
    assert _ledger(folder)[1][name] == 1


def test_an_async_environment_abandoned_mid_step_is_closed_once_its_cleanup_is_over(
    catalog_yaml, user_package, tmp_path
):
    """The text adapter's abandoned step is cancelled, and its cleanup may await: the close waits for the
    cancelled call to be done, never closing the environment under its own cleanup (a review)."""
    catalog_yaml["workload"]["trajectory_timeout_s"] = 0.3
    spec = _spec(catalog_yaml, {"entry": "my_envs:CleansUpSlowly", "adapter": "text"})
    episode = _pool(spec)[0].new_group()[0]

    async def main() -> None:
        await episode.reset()
        assert (await episode.step([5, 6])).timed_out
        await episode.close()
        await asyncio.sleep(0.5)  # the cleanup (0.2 s) is over, and the close has run behind it

    asyncio.run(main())
    assert [kind for kind, *_ in _notes(tmp_path)] == ["closed"]  # once, never "closed-during-cleanup"


def test_an_abandoned_call_never_holds_the_process_open():
    script = textwrap.dedent(
        """
        import asyncio, time
        from targets.harness.environments.adapters import in_user_thread

        async def main():
            call = asyncio.ensure_future(in_user_thread(time.sleep, 60))
            done, _ = await asyncio.wait({call}, timeout=0.1)
            assert not done
            call.cancel()

        asyncio.run(main())
        print("left")
        """
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert run.returncode == 0 and "left" in run.stdout, run.stderr


def test_what_no_future_can_hold_is_still_named_and_a_pile_of_running_calls_is_refused(
    catalog_yaml, user_package, monkeypatch
):
    spec = _spec(catalog_yaml, {"entry": "my_envs:Exhausted", "adapter": "gymnasium"})
    episode = _pool(spec)[0].new_group()[0]
    asyncio.run(episode.reset())
    asyncio.run(episode.step([5, 6]))
    with pytest.raises(UserEnvironmentError, match="my_envs:Exhausted raised RuntimeError at turn 2 of g0/e0: StopIt"):
        asyncio.run(episode.step([5, 6]))

    from targets.harness.environments import adapters

    monkeypatch.setattr(adapters, "RUNNING", threading.BoundedSemaphore(1))
    adapters.RUNNING.acquire()  # one call still running: the most this test allows
    with pytest.raises(RuntimeError, match="1024 calls of the environment are still running"):
        asyncio.run(adapters.in_user_thread(print, "never"))


def test_a_step_after_the_trajectorys_time_is_up_never_reaches_the_environment(catalog_yaml, user_package, tmp_path):
    catalog_yaml["workload"]["trajectory_timeout_s"] = 0.2
    spec = _spec(catalog_yaml, {"entry": "my_envs:Breaks", "adapter": "gymnasium"})
    episode = _pool(spec)[0].new_group()[0]
    asyncio.run(episode.reset())
    time.sleep(0.3)
    result = asyncio.run(episode.step([5, 6]))
    assert result.done and result.timed_out and not _notes(tmp_path, "stepped")  # never asked


def test_env_state_is_the_harness_environments_not_a_users(catalog_yaml, user_package):
    """A crash that loses state is modelled on the harness's environments; a user's crashes (or not)
    on its own, so a spec modelling it there is refused by name."""
    catalog_yaml["workload"]["env_state"] = {"change_rate": 0.2, "checkpoint_s": 1, "restore_s": 2}
    with pytest.raises(SpecError, match="env_state models crashes.*my_envs:HiddenNumber is the user's"):
        _spec(catalog_yaml, {"entry": "my_envs:HiddenNumber", "adapter": "gymnasium"})


def _evaluated(episode, tokenizer, text: str):
    """The step whose action is ``text``, a candidate's engine's (it evaluates as code in ``EvalScored``)."""
    asyncio.run(episode.reset())
    return asyncio.run(episode.step(tokenizer.encode(text, add_special_tokens=False)))


def test_an_action_evaluated_as_code_never_reaches_the_harness(catalog_yaml, user_package):
    """A scorer that evaluates the model's answer ran the candidate's text in the harness's process: an
    answer that replaced the trace's record method would have hidden its episodes from the audit. It runs in
    the environment's process now: what it patches there, the harness never sees."""
    from targets.harness.trace import Trace as HarnessTrace

    spec = _spec(catalog_yaml, {"entry": "my_envs:eval_scored", "adapter": "tasks"})
    tokenizer = load_tokenizer(model_dir(spec.model))
    record = HarnessTrace.record
    patch = (
        "setattr(__import__('targets.harness.trace', fromlist=['Trace']).Trace, 'record', lambda *a, **k: None) or 1"
    )
    pool, trace = _pool(spec)
    try:
        result = _evaluated(pool.new_group()[0], tokenizer, patch)
    finally:
        patched, HarnessTrace.record = HarnessTrace.record is not record, record  # restored: other tests use it
    assert result.reward == 1.0  # the text ran, in the environment's process
    assert not patched and [e.kind for e in trace.events if e.kind == "env_step"] == ["env_step"]
    pool.close()


@pytest.mark.skipif(not sandbox_module._bubblewrap_works(), reason="bubblewrap cannot run here")
def test_a_sandboxed_environment_sees_no_run_folder_no_harness_and_writes_only_where_it_says(
    catalog_yaml, user_package, tmp_path
):
    """Under bubblewrap the environment's process sees no harness process, no run folder (the trace, the
    weights), and writes nowhere but its /tmp and the folders its spec names ``writable``."""
    run, notes = tmp_path / "run", tmp_path / "notes"
    run.mkdir()
    notes.mkdir()
    (run / "trace.jsonl").write_text("the harness's\n")
    environment = {"entry": "my_envs:eval_scored", "adapter": "tasks", "writable": [str(notes)]}
    spec = _spec(catalog_yaml, environment)
    tokenizer = load_tokenizer(model_dir(spec.model))
    clock = WallClock()
    listening = socket.create_server(("127.0.0.1", 0))  # a service of the machine's
    port = listening.getsockname()[1]
    pool = EnvironmentPool(
        spec.workload,
        clock,
        Trace(clock),
        model_path=str(model_dir(spec.model)),
        confinement=Confinement(Sandbox("bubblewrap"), (run,)),
    )
    checkout = Path(__file__).resolve().parents[1]
    sysctl = "/proc/sys/kernel/printk_ratelimit"  # written as it is, had the write been let through
    probes = {
        "read": f"len(open('{run}/trace.jsonl').read())",
        "forge": f"open('{run}/trace.jsonl', 'a').write('forged')",  # a tmpfs there: the run's file untouched
        "signal": f"__import__('os').kill({os.getpid()}, 0)",  # no harness process in its namespace
        "plant": f"open('{checkout}/targets/planted.py', 'w').write('x')",
        "note": f"open('{notes}/said.txt', 'w').write('ok')",
        # a red team's, run as root: a sysctl written (core_pattern's pipe runs outside every namespace), and
        # localhost, abstract sockets and the machine's service sockets under /run reached
        "sysctl": f"open('{sysctl}', 'w').write(open('{sysctl}').read())",
        "localhost": f"__import__('socket').create_connection(('127.0.0.1', {port}), timeout=5).close() or 1",
        "run": "len(__import__('os').listdir('/run'))",
    }
    said = {}
    for name, text in probes.items():
        try:
            said[name] = _evaluated(pool.new_group()[0], tokenizer, text).reward
        except UserEnvironmentError as error:
            said[name] = str(error)
    pool.close()
    assert "Read-only file system" in said["sysctl"], said
    assert "raised ConnectionRefusedError" in said["localhost"] and said["run"] == 0.0, said
    assert said["forge"] == 6.0 and (run / "trace.jsonl").read_text() == "the harness's\n"
    assert "raised FileNotFoundError" in said["read"], said
    assert "raised ProcessLookupError" in said["signal"], said
    assert "Read-only file system" in said["plant"] and not (checkout / "targets" / "planted.py").exists(), said
    assert said["note"] == 2.0 and (notes / "said.txt").read_text() == "ok"
    environment["network"] = True  # an environment that calls a service says so
    spec = _spec(catalog_yaml, environment)
    pool = EnvironmentPool(
        spec.workload,
        clock,
        Trace(clock),
        model_path=str(model_dir(spec.model)),
        confinement=Confinement(Sandbox("bubblewrap")),
    )
    assert _evaluated(pool.new_group()[0], tokenizer, probes["localhost"]).reward == 1.0
    pool.close()
    listening.close()
    environment["writable"] = [str(tmp_path / "nowhere")]  # a folder this machine lacks: named before it starts
    with pytest.raises(UserEnvironmentError, match=r"writable .*/nowhere is no folder here"):
        _pool(_spec(catalog_yaml, environment))


def test_a_user_environment_runs_under_bubblewrap_or_not_at_all_beside_docker(catalog_yaml, user_package, monkeypatch):
    """Beside the Docker sandbox the environment's process ran plain: a red team's answer read the task key
    from the harness's /proc/PID/environ and wrote into its memory through /proc/PID/mem. It runs under
    bubblewrap whatever sandbox holds the candidate, and is refused where bubblewrap cannot run (a plain process
    only where the user named --sandbox subprocess, no isolation at all)."""
    from targets.harness.isolation import sandbox

    monkeypatch.setattr(sandbox, "_bubblewrap_works", lambda: False)
    spec = _spec(catalog_yaml, {"entry": "my_envs:eval_scored", "adapter": "tasks"})
    clock = WallClock()
    with pytest.raises(UserEnvironmentError, match="runs under bubblewrap, which cannot run here .the docker sandbox"):
        EnvironmentPool(
            spec.workload,
            clock,
            Trace(clock),
            model_path=str(model_dir(spec.model)),
            confinement=Confinement(Sandbox("docker", "an-image")),
        )


def test_the_check_limit_times_the_users_code_not_the_hosts_start(catalog_yaml, user_package, monkeypatch, tmp_path):
    """The entry check's limit covered the host's interpreter and the harness's imports too: on a loaded
    machine a quick entry was called "did not finish" (the suite's 0.5 s check did). The host says it has
    started before it reads the entry; the limit runs from there."""
    from targets.harness.environments import hosted

    slow = tmp_path / "slow-python"
    slow.write_text(f'#!/bin/sh\nsleep 3\nexec {sys.executable} "$@"\n')
    slow.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(slow))  # a host that takes 3 s more to start
    monkeypatch.setattr(hosted, "CHECK_LIMIT_S", 1.5)
    quick = _spec(catalog_yaml, {"entry": "my_envs:eval_scored", "adapter": "tasks"}).workload.environment
    hosted.check_environment(quick)  # made and closed well within 1.5 s once started


def test_an_answer_line_past_its_limit_ends_the_host_by_name(catalog_yaml, user_package, monkeypatch):
    """What the host writes is read a line at a time: a red team's answer wrote 768 MB with no end of line
    into its answers and the harness's memory grew by as much. A line past ``LINE_LIMIT`` ends the host."""
    from targets.harness.environments import hosted

    monkeypatch.setattr(hosted, "LINE_LIMIT", 4096)
    spec = _spec(catalog_yaml, {"entry": "my_envs:eval_scored", "adapter": "tasks"})
    tokenizer = load_tokenizer(model_dir(spec.model))
    pool, _ = _pool(spec)
    flood = "__import__('os').write(4, b'x' * 8192) and 1"  # fd 4: its answers (host.py dups stdin, then stdout)
    with pytest.raises(UserEnvironmentError, match="answered out of protocol .a line of 4096 bytes with no end"):
        _evaluated(pool.new_group()[0], tokenizer, flood)
    pool.close()


def test_an_answer_nested_past_the_stack_ends_the_host_by_name(catalog_yaml, user_package):
    """An answer of JSON nested 100,000 deep raises RecursionError as it is parsed, not ValueError: the reader
    thread died on it and the episode's call waited for an answer that no thread would hand it. It is out of
    protocol, and named so, as any malformed answer is."""
    spec = _spec(catalog_yaml, {"entry": "my_envs:eval_scored", "adapter": "tasks"})
    tokenizer = load_tokenizer(model_dir(spec.model))
    pool, _ = _pool(spec)
    deep = "__import__('os').write(4, b'[' * 100000 + b']' * 100000 + b'\\n') and 1"  # fd 4: its answers
    episode = pool.new_group()[0]

    async def evaluated():  # bounded: on the old code the call never ended
        await episode.reset()
        return await asyncio.wait_for(episode.step(tokenizer.encode(deep, add_special_tokens=False)), 60)

    with pytest.raises(UserEnvironmentError, match="answered out of protocol .maximum recursion depth"):
        asyncio.run(evaluated())
    pool.close()


@pytest.mark.parametrize(
    ("line", "named"),
    [
        (b"[1]", "has the fields id, ok, step, cancelled, user, raised"),
        (b'{"id": 1, "ok": 1}', "has the fields"),
        (b'{"id": true, "ok": 1, "step": null, "cancelled": false, "user": null, "raised": null}', "id is True"),
        (b'{"id": 1, "ok": 1, "step": null, "cancelled": true, "user": "no", "raised": null}', "one of them"),
        (b'{"id": 1, "ok": 1, "step": {"fields": [1]}, "cancelled": false, "user": null, "raised": null}', "step is"),
        (b'{"id": 1, "ok": 1, "step": null, "cancelled": false, "user": null, "raised": [1, 2]}', "raised is"),
        (
            b'{"id": 1, "ok": 1, "step": {"fields": null, "not_a_step": 2}, "cancelled": false, "user": null, '
            b'"raised": null}',
            "one of them",
        ),
    ],
)
def test_an_answer_out_of_shape_is_named(line, named):
    """What the environment's process answers is parsed into its typed message and checked on the way: its
    code runs the candidate's text, so a line of the wrong shape is named, never half-read."""
    from targets.harness.environments.wire import Answer, parse

    with pytest.raises(ValueError, match=named):
        parse(line, Answer)


def test_every_message_reads_back_as_it_was_sent():
    from targets.harness.environments.wire import Answer, Load, Loaded, Request, Started, Step, encode, parse

    sent = [
        Started(),
        Load("my_envs:eval_scored", "tasks", "gASVAgAAAAAAAAB9lC4="),
        Loaded(loaded=False, error="no such entry"),
        Request(op="step", id=3, env=1, action="42"),
        Answer(3, step=Step(fields=["seen", 1.0, True, False])),
        Answer(4, step=Step(not_a_step={"type": "NoneType", "repr": "None"})),
        Answer(5, ok=None),
        Answer(6, raised=("KeyError", "'task'")),
    ]
    assert [parse(encode(message), type(message)) for message in sent] == sent
