"""One request of the paged engine (``paged_engine.py``): its tokens so far, the KV blocks that hold
them, how far they are computed, and how it finished. The engine moves it between ``waiting`` and
``running`` (a new one queues by its arrival, ``queue_by_arrival``); a preempted one goes back to waiting
with nothing computed and recomputes its context."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from targets.api import Completion, SamplingParams, TokenIds


@dataclass(eq=False)  # a request is itself: compared by identity
class Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    episode: str | None
    tokens: list[int] = field(default_factory=list)  # prompt + generated
    logprobs: list[float] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    computed: int = 0  # leading tokens whose keys and values are in the cache
    finish: str | None = None
    generator: torch.Generator | None = None
    done: threading.Event = field(default_factory=threading.Event)
    ngrams: dict[tuple[int, ...], int] = field(default_factory=dict)  # speculative drafts: n-gram -> its latest start
    indexed: int = 0  # start positions in ``ngrams`` so far
    arrival: int = 0  # the cluster's order of arrival (the engine's own id when called directly)
    # what calibration reads of the engine's work (``Completion.queued_s``, ``cached_tokens``)
    waiting_since: float | None = field(default_factory=time.perf_counter)  # waiting since; None while it runs
    queued_s: float = 0.0  # seconds it waited before its admissions so far
    cached_tokens: int | None = None  # its prompt's tokens its first admission reused from the prefix cache

    def admitted(self) -> None:
        """It leaves the waiting queue for the running batch (its reused prefix in ``computed``)."""
        self.queued_s += time.perf_counter() - self.waiting_since
        self.waiting_since = None
        if self.cached_tokens is None:
            self.cached_tokens = self.computed

    def waits(self) -> None:
        """It joins the waiting queue (submitted, or preempted)."""
        self.waiting_since = time.perf_counter()

    def completion(self, version: int, engine: str) -> Completion:
        """What it has generated so far, under ``version``, and what the engine says of its work on it."""
        waited = self.queued_s + (0.0 if self.waiting_since is None else time.perf_counter() - self.waiting_since)
        return Completion(self.generated, list(self.logprobs), self.finish, version, engine, waited, self.cached_tokens)

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt) :]

    @property
    def decoded(self) -> bool:  # some tokens generated (under the weights it started with)
        return len(self.tokens) > len(self.prompt)


def refuse_unfit(engine: str, prompt: TokenIds, params: SamplingParams, capacity_tokens: int) -> None:
    """A request no engine could serve is refused at submission, naming why (never stepped and lost)."""
    if len(prompt) + params.max_new_tokens > capacity_tokens:
        raise ValueError(
            f"{engine}: a request of {len(prompt)} + {params.max_new_tokens} tokens exceeds the KV "
            f"cache's {capacity_tokens} tokens"
        )
    if not prompt:
        raise ValueError(f"{engine}: an empty prompt")


def queue_by_arrival(waiting: deque[Request], request: Request) -> None:
    """Queues ``request`` behind every waiting request that arrived before it (engines admit in arrival
    order, and Ray may deliver a long prompt's call after a later one), never ahead of a preempted request
    that decoded (it is older than anything that came after it, whatever its number)."""
    at = len(waiting)
    while at and waiting[at - 1].arrival > request.arrival and not waiting[at - 1].decoded:
        at -= 1
    waiting.insert(at, request)


def step_takes(batch: list[Request], prefill_chunk: int) -> list[int]:
    """How many of its uncomputed tokens each request of a step computes: a decoding request its last
    token; a prefilling one the rest of its context, or with ``prefill_chunk`` (the ``chunked_prefill``
    skill) its share of that many tokens a step, in admission order (0: it waits for the next step)."""
    takes, left = [], prefill_chunk
    for request in batch:
        remaining = len(request.tokens) - request.computed
        if remaining <= 1 or not prefill_chunk:
            takes.append(remaining)
            continue
        takes.append(min(remaining, left))
        left -= takes[-1]
    return takes
