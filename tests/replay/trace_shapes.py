"""Synthetic traces of four shapes for the miss-ratio estimator's test: each a list of
TraceRequest with 512-token blocks, prefix-consistent hash ids, from a seeded generator."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable

from blockserve.replay.trace import TraceRequest

BLOCK = 512


def _request(index: int, ids: list[int], rng: random.Random) -> TraceRequest:
    return TraceRequest(
        index, len(ids) * BLOCK - rng.randrange(BLOCK), rng.randint(1, 300), tuple(ids)
    )


def skewed(rng: random.Random, num_requests: int = 3000) -> list[TraceRequest]:
    """Every request opens with one 10-block system prompt, then one of 100 tool prompts chosen
    by a Zipf-like law, then a distinct tail."""
    ids = itertools.count(1000)
    tools = [[next(ids) for _ in range(rng.randint(2, 20))] for _ in range(100)]
    trace = []
    for index in range(num_requests):
        tool = tools[min(int(rng.paretovariate(1.1)) - 1, 99)]
        trace.append(
            _request(
                index, [*range(10), *tool, *(next(ids) for _ in range(rng.randint(1, 12)))], rng
            )
        )
    return trace


def many_distinct(rng: random.Random, num_requests: int = 3000) -> list[TraceRequest]:
    """Mostly new blocks; one request in twenty repeats an earlier one."""
    ids = itertools.count()
    trace: list[TraceRequest] = []
    for index in range(num_requests):
        if trace and rng.random() < 0.05:
            prompt = list(trace[rng.randrange(len(trace))].hash_ids)
        else:
            prompt = [next(ids) for _ in range(rng.randint(1, 30))]
        trace.append(_request(index, prompt, rng))
    return trace


def few_distinct(rng: random.Random, num_requests: int = 3000) -> list[TraceRequest]:
    """40 prompts of up to 40 blocks, drawn at random, over and over."""
    ids = itertools.count()
    prompts = [[next(ids) for _ in range(rng.randint(1, 40))] for _ in range(40)]
    return [_request(index, rng.choice(prompts), rng) for index in range(num_requests)]


def conversations(rng: random.Random, num_requests: int = 1500) -> list[TraceRequest]:
    """Long conversations, 30 at a time: each turn re-sends the conversation so far and adds
    a few blocks; an ended conversation (one in ten turns, or past 110 blocks, so that every
    request fits the smallest cache replayed) is replaced by a new one."""
    ids = itertools.count()
    active: list[list[int]] = []
    trace = []
    for index in range(num_requests):
        while len(active) < 30:
            active.append([next(ids) for _ in range(rng.randint(20, 80))])
        turn = rng.randrange(len(active))
        active[turn] = [*active[turn], *(next(ids) for _ in range(rng.randint(1, 6)))]
        trace.append(_request(index, active[turn], rng))
        if rng.random() < 0.1 or len(active[turn]) > 110:
            active.pop(turn)
    return trace


SHAPES: dict[str, Callable[[random.Random], list[TraceRequest]]] = {
    "skewed": skewed,
    "many-distinct": many_distinct,
    "few-distinct": few_distinct,
    "conversations": conversations,
}
