"""The harness side of one episode: lifecycle, latency, timeout and the trace record.

Subclasses only say what the task is (``make_task``), what the agent first sees
(``first_observation``) and how the world answers an action (``respond``). Everything a candidate
could game — the clock, the latency, the reward bookkeeping, the record — lives here.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict

from targets.api import StepResult, TokenCount, TokenIds, TraceEvent
from targets.errors import UserError
from targets.harness.clock import Clock
from targets.harness.tokenizer import CTX, DIGITS, LETTERS, VOCAB
from targets.harness.trace import Trace


class ActionWords(Sequence[str]):
    """An action's words, decoded on access: an environment reads a few words of what may be a
    response of hundreds of tokens, and decoding all of them would dominate a simulated run."""

    def __init__(self, tokens: TokenIds) -> None:
        self._tokens = tokens

    def __len__(self) -> int:
        return len(self._tokens)

    def __getitem__(self, index):
        if isinstance(index, slice):
            tokens = self._tokens[index]
            word = VOCAB.word
            return [word(t) for t in (tokens.tolist() if hasattr(tokens, "tolist") else tokens)]
        return VOCAB.word(int(self._tokens[index]))  # (a simulated response is a numpy array)


if TYPE_CHECKING:
    from targets.spec import WorkloadSpec

# the words drawn into a text's padding: the context filler, digits and letters (no word an environment's
# text starts with, no end or action mark); the last DRAWN_FILLER words of the padding are drawn
FILLER_IDS = [VOCAB.ids[word] for word in (CTX, *DIGITS, *LETTERS)]
DRAWN_FILLER = 8


class NoParams(BaseModel):
    model_config = ConfigDict(extra="forbid")


def drawn_turns(workload: WorkloadSpec, rng: random.Random) -> int:
    """The turns an episode of an environment that draws them plays, the first draw of its own ``rng``
    (a timeout, a lost environment or a full context ends it sooner). The audit draws it again from the
    episode's seed to judge a member by what it was, however far the stack let it run."""
    return max(1, min(workload.turns.max, int(round(workload.turns.dist.sample(rng)))))


class Episode:
    name: ClassVar[str]
    Params: ClassVar[type[BaseModel]] = NoParams
    draws_turns: ClassVar[bool] = False  # True: the turn count comes from workload.turns.dist
    asynchronous: ClassVar[bool] = False  # True: reset and step await the environment (a user's own)

    def __init__(
        self,
        *,
        episode_id: str,
        group_id: str,
        task_seed: int,
        episode_seed: int,
        workload: WorkloadSpec,
        clock: Clock,
        trace: Trace,
        task: Any = None,
        counts: bool = False,
    ) -> None:
        """``task``: the task another member of the group made from the same ``task_seed`` (members share
        it rather than each drawing it again). ``counts``: a simulated run's episode, which answers with
        token counts (``TokenCount``) and computes everything else as a real one does."""
        self.counts = counts
        self.episode_id = episode_id
        self.group_id = group_id
        self.workload = workload
        self.params = self.Params.model_validate(workload.environment.params)
        self.clock = clock
        self.trace = trace
        self.rng = random.Random(episode_seed)
        self.reset_rng = random.Random(f"reset/{episode_seed}")  # its own: a workload with resets draws the rest alike
        # the filler a text is padded with, from streams of their own (the rest draws as it did): the opening
        # prompt's from the task's seed (a group's members share it, and their prefix), each observation's
        # from the episode's; both keyed, so no cluster can sample the run's prompts before it starts
        self.prompt_filler = random.Random(f"filler/{task_seed}")
        self.observation_filler = random.Random(f"filler/{episode_seed}")
        self.task = self.make_task(random.Random(task_seed)) if task is None else task
        self.max_turns = drawn_turns(workload, self.rng) if self.draws_turns else workload.turns.max
        self.turn = 0
        self.context_tokens = 0  # prompt + actions + observations so far
        self.context: list[int] = []  # their ids (a real run's: what a reward model reads)
        self.last_step: TraceEvent | None = None  # the latest env_step recorded
        self.started_at: float | None = None
        self.resetting = False  # between begin_reset and end_reset
        self.done = False
        self.stepping = False  # between begin_step and end_step
        self.total_reward = 0.0
        # what a crash may lose (workload.env_state): the last turn that changed state, the last turn
        # checkpointed (turn 0, the reset state, is remade from the task), a checkpoint in progress
        self.changed_turn = 0
        self.checkpoint_turn = 0
        self.checkpoint_began: float | None = None  # a checkpoint in progress, since then
        self._crashed = False  # the step in flight crashed with state no checkpoint held

    # -- what a subclass defines ---------------------------------------------------------------
    def make_task(self, rng: random.Random) -> Any:
        raise NotImplementedError

    def first_observation(self) -> str:
        raise NotImplementedError

    def respond(self, action_words: Sequence[str]) -> tuple[str, float, bool]:
        """Answer one action: (observation text, reward, done)."""
        raise NotImplementedError

    # -- the EnvHandle protocol ----------------------------------------------------------------
    async def reset(self) -> TokenIds:
        seconds = self.begin_reset()
        if seconds:
            await self.clock.sleep(seconds)
        return self.end_reset()

    async def step(self, action: TokenIds) -> StepResult:
        latency, failures = self.begin_step()
        await self.clock.sleep(latency)
        return self.end_step(action, latency, failures)

    async def checkpoint(self) -> None:
        seconds = self.begin_checkpoint()
        try:
            await self.clock.sleep(seconds)
        except BaseException:  # cancelled before it was taken: none was, and the episode may step again
            self.checkpoint_began = None
            raise
        self.end_checkpoint()

    # -- the same, as the harness's link serves them: each a timer -------------------------------
    def begin_reset(self) -> float:
        """Check the reset may happen; the seconds it takes (``workload.env_reset_s``, drawn from a stream of
        its own, so that the same episode with and without resets draws the same turns and latencies):
        ``end_reset`` after them. The trajectory's time starts here, as its timeout's does."""
        self._start()
        self.resetting = True
        reset = self.workload.env_reset_s
        return 0.0 if reset is None else max(0.0, reset.sample(self.reset_rng))

    def end_reset(self) -> TokenIds:
        self.resetting = False
        return self._reset_with(self._padded(self.first_observation(), self.workload.tokens.prompt, self.prompt_filler))

    def _start(self) -> None:
        if self.started_at is not None:
            raise RuntimeError(f"episode {self.episode_id} was reset twice")
        self.started_at = self.clock.now()

    def _reset_with(self, prompt: TokenIds) -> TokenIds:
        self.context_tokens = len(prompt)
        if not self.counts:
            self.context = [int(t) for t in prompt]
        self.trace.record(  # latency: how long the environment took to reset (a user's own: its time)
            "env_reset",
            episode=self.episode_id,
            group=self.group_id,
            observation=self.trace.tokens(prompt),
            latency=self.clock.now() - self.started_at,
        )
        return prompt

    def begin_step(self) -> tuple[float, int]:
        """Check the step may happen; (seconds it takes, failures on the way): ``end_step`` after them."""
        if self.started_at is None or self.resetting:
            raise RuntimeError(f"episode {self.episode_id} stepped before its reset answered")
        if self.done:
            raise RuntimeError(f"episode {self.episode_id} stepped after it was done")
        if self.stepping or self.checkpointing:
            doing = "its previous step" if self.stepping else "its checkpoint"
            raise RuntimeError(f"episode {self.episode_id} stepped while {doing} was still running")
        self.stepping = True
        return self._latency()

    def begin_checkpoint(self) -> float:
        """Check a checkpoint may be taken now, at a turn boundary of a live episode; the seconds it
        takes (``end_checkpoint`` after them). A checkpoint in the middle of a step would save state
        the turn has not reached, so it is the controller's error, as a step during a step is."""
        state = self.workload.env_state
        if state is None:
            raise ValueError(
                f"episode {self.episode_id} checkpointed, but this workload's environments keep their state "
                "through a crash (the target has no workload.env_state)"
            )
        if self.started_at is None or self.resetting:
            raise RuntimeError(f"episode {self.episode_id} checkpointed before its reset answered")
        if self.done:
            raise RuntimeError(f"episode {self.episode_id} checkpointed after it was done")
        if self.stepping or self.checkpointing:
            doing = "a step" if self.stepping else "another checkpoint"
            raise RuntimeError(f"episode {self.episode_id} checkpointed while {doing} was still running")
        self.checkpoint_began = self.clock.now()
        return state.checkpoint_s

    @property
    def checkpointing(self) -> bool:
        return self.checkpoint_began is not None

    def end_checkpoint(self) -> None:
        began, self.checkpoint_began = self.checkpoint_began, None
        self.checkpoint_turn = self.turn
        self.trace.record(
            "env_checkpoint",
            episode=self.episode_id,
            group=self.group_id,
            turn=self.turn,
            start=began,
            mb=self.workload.env_state.checkpoint_mb,
        )

    def end_step(
        self,
        action: TokenIds,
        latency: float,
        failures: int,
        answer: tuple[str, float, bool, bool] | None = None,
    ) -> StepResult:
        """The world's answer to ``action``, ``latency`` seconds after ``begin_step``: ``answer`` when
        the environment already gave it (a user's own: its text, reward, end and whether the end was a
        limit of its own), else ``respond``'s."""
        self.stepping = False
        self.turn += 1
        timed_out = self.clock.now() - self.started_at > self.workload.trajectory_timeout_s
        lost, self._crashed = self._crashed and not timed_out, False  # a timeout ends it first: counted once
        capped = False  # the turn cap ended it where the environment would have gone on
        env_truncated = False  # the environment's own limit ended it (gymnasium's truncated), not its play
        if timed_out:
            text, reward, done = "timeout", 0.0, True
        elif lost:  # the sandbox is gone and nothing can bring back its state: the episode ends here
            text, reward, done = "lost", 0.0, True
        else:
            if answer is not None:
                text, reward, done, env_truncated = answer
            else:
                text, reward, done = self.respond(ActionWords(action))
            capped = not done and self.turn >= self.max_turns
            done = done or capped
        observation = [] if done else self.observe(text, action)
        self.context_tokens += len(action) + len(observation)
        tokens = self.workload.tokens
        truncated = not done and self.context_tokens + tokens.response > tokens.max_sequence
        if truncated:  # the context window is full: the episode ends here, as a real agent's would
            self.context_tokens -= len(observation)
            observation, done = [], True
        if not self.counts:
            self.context += [int(t) for t in action] + [int(t) for t in observation]
        self.done = done
        self.total_reward += reward
        changed = self._changes_state()
        self.last_step = self.trace.record(
            "env_step",
            episode=self.episode_id,
            group=self.group_id,
            turn=self.turn,
            action=self.trace.tokens(action),
            observation=self.trace.tokens(observation),
            reward=reward,
            done=done,
            timed_out=timed_out,
            truncated=truncated,
            capped=capped,
            env_truncated=env_truncated,
            latency=latency,
            failures=failures,
            lost=lost,
            state_changed=changed,
        )
        return StepResult(observation, reward, done, timed_out, state_changed=changed, lost=lost)

    def _changes_state(self) -> bool:
        """Whether this turn changed state a crash would lose: a draw at ``env_state.change_rate``
        for a live episode (Crab measured most turns change none); every turn where crashes lose
        nothing (there is nothing to skip)."""
        state = self.workload.env_state
        if state is None:
            return True
        if self.done or self.rng.random() >= state.change_rate:
            return False
        self.changed_turn = self.turn
        return True

    def observe(self, text: str, action: TokenIds) -> TokenIds | TokenCount:
        """The tokens of the observation ``text`` that answers ``action``."""
        return self._padded(text, self.workload.tokens.observation, self.observation_filler)

    def _latency(self) -> tuple[float, int]:
        """Seconds the step takes, and how many times the environment failed on it: each attempt
        takes a latency draw (capped at ``env_latency_max_s``); with chance ``env_failure_rate`` it
        fails, the environment restarts (``env_restart_s``: a fresh sandbox replayed to the state
        before the step) and the step is tried again. The agent sees only the time it took.

        With ``env_state`` a failure loses the sandbox's state: the harness restores the episode's
        own last checkpoint (``restore_s``) when no turn since changed state, and otherwise the
        episode is lost (``end_step`` ends it)."""
        w = self.workload

        def attempt() -> float:
            return min(w.env_latency_s.sample(self.rng), w.env_latency_max_s)

        seconds, failures = attempt(), 0
        while w.env_failure_rate and self.rng.random() < w.env_failure_rate:
            failures += 1
            if w.env_state is None:
                seconds += w.env_restart_s + attempt()
            elif self.checkpoint_turn >= self.changed_turn:
                seconds += w.env_state.restore_s + attempt()
            else:
                self._crashed = True
                break
        return seconds, failures

    def _padded(self, text: str, length: int, filler: random.Random) -> TokenIds | TokenCount:
        """Left-padded to the workload's token budget (never truncated): context filler, then the last
        ``DRAWN_FILLER`` words before the text drawn from ``filler``. A constant filler left a handful of
        openings (4 on tiny-qwen3-cpu, 64 on the 0.6B target), which a cluster could sample under version 0
        while it started up, untimed, and answer from stock (a red team's did, and passed the check): drawn,
        there are 37^8 (3.5 x 10^12) for each. The constant part stays a prefix every task shares, as a
        system prompt is in a real workload (an engine's prefix cache reuses it across groups)."""
        if self.counts:
            return TokenCount(max(length, len(text.split())))
        tokens = VOCAB.encode(text)
        pad = max(0, length - len(tokens))
        drawn = min(pad, DRAWN_FILLER)
        return [VOCAB.ids[CTX]] * (pad - drawn) + filler.choices(FILLER_IDS, k=drawn) + tokens


async def close_environments(episodes: Iterable[Episode]) -> list[UserError]:
    """Every user environment of ``episodes`` closed (a built-in one holds nothing), each whatever
    another's close raised; what the closes raised, for the caller to fail on or to say."""
    failed = []
    for episode in episodes:
        if episode.asynchronous:
            try:
                await episode.close()
            except UserError as error:
                failed.append(error)
    return failed
