"""An HttpRun over a scripted engine client: prompts submitted together, outputs merged by prompt,
a refusal closes every stream, a failed request is a 500, a stream ends with [DONE]."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from blockserve.engine.outputs import CompletionOutput, EngineStats, RequestMetrics, RequestOutput
from blockserve.engine.request import RequestSpec
from blockserve.errors import ClientDisconnectedError, InvalidRequestError, RequestFailedError
from blockserve.sampling_params import SamplingParams
from blockserve.server.context import ServingContext
from blockserve.server.http_run import HttpRun, final_outputs, stream_response
from blockserve.server.metrics import ServerMetrics


def snapshot(request_id: str, text: str, finished: bool, error: str | None = None) -> RequestOutput:
    reason = ("error" if error else "length") if finished else None
    choice = CompletionOutput(0, text, tuple(range(len(text))), finish_reason=reason)
    return RequestOutput(
        request_id, None, (1, 2), 0, (choice,), finished, RequestMetrics(0.0), error=error
    )


class ScriptedClient:
    """Yields scripted snapshots per prompt (by its first token id), or none ever for an empty
    script (a request that stays queued); records specs and the streams closed before they
    finished."""

    def __init__(self, scripts: dict[int, list[str] | Exception], error: str | None = None) -> None:
        self.scripts = scripts
        self.error = error
        self.specs: list[RequestSpec] = []
        self.closed_early: list[str] = []

    async def generate(self, spec: RequestSpec) -> AsyncIterator[RequestOutput]:
        self.specs.append(spec)
        script = self.scripts[spec.prompt[0]]  # type: ignore[index]
        if isinstance(script, Exception):
            raise script
        finished = False
        try:
            if not script:
                await asyncio.Event().wait()  # queued for ever: only a close ends it
            for i, text in enumerate(script):
                finished = i == len(script) - 1
                error = self.error if finished else None
                await asyncio.sleep(0)
                yield snapshot(spec.request_id, text, finished, error)
        finally:
            if not finished:
                self.closed_early.append(spec.request_id)

    def stats(self) -> EngineStats:
        return EngineStats(0, 0, 0.0, 0, 0, 0, 0, 0)


class StaysConnected:
    async def is_disconnected(self) -> bool:
        return False


class LeavesAfter:
    """A client that is connected for `polls` polls, then gone."""

    def __init__(self, polls: int) -> None:
        self.polls = polls

    async def is_disconnected(self) -> bool:
        self.polls -= 1
        return self.polls < 0


def make_run(client: ScriptedClient, prompts: list[tuple[int, ...]]) -> HttpRun:
    metrics = ServerMetrics(client, "m")  # type: ignore[arg-type]
    ctx = ServingContext(client, "m", None, metrics)  # type: ignore[arg-type]
    return HttpRun(ctx, "cmpl-1", prompts)  # type: ignore[arg-type]


def test_every_prompt_runs_and_finals_come_in_prompt_order() -> None:
    """Two prompts get engine ids <run>-0 and <run>-1; the final snapshots come in order."""
    client = ScriptedClient({1: ["a", "ab", "abc"], 2: ["x", "xy"]})
    run = make_run(client, [(1,), (2,)])

    async def main() -> list[RequestOutput]:
        await run.start(SamplingParams(), 0, None, StaysConnected())  # type: ignore[arg-type]
        return await final_outputs(run, StaysConnected())  # type: ignore[arg-type]

    finals = asyncio.run(main())
    ids = [s.request_id for s in client.specs]
    assert [i.rsplit("-", 1)[1] for i in ids] == ["0", "1"]
    assert ids[0].rsplit("-", 1)[0] == ids[1].rsplit("-", 1)[0]
    assert [f.outputs[0].text for f in finals] == ["abc", "xy"]
    assert client.closed_early == []


def test_a_refused_prompt_refuses_the_batch_and_closes_the_others() -> None:
    """When one prompt is refused the error is raised and the accepted one is aborted."""
    client = ScriptedClient({1: ["a", "ab"], 2: InvalidRequestError("bad prompt", "prompt")})
    run = make_run(client, [(1,), (2,)])
    with pytest.raises(InvalidRequestError, match="bad prompt"):
        asyncio.run(run.start(SamplingParams(), 0, None, StaysConnected()))  # type: ignore[arg-type]
    assert client.closed_early == [client.specs[0].request_id]


def test_the_client_label_is_echoed_never_an_engine_key() -> None:
    """Two runs labelled alike reach the engine under ids of their own, neither the label."""
    client = ScriptedClient({1: ["a"], 2: ["b"]})
    runs = [make_run(client, [(1,)]), make_run(client, [(2,)])]

    async def main() -> None:
        for run in runs:
            await run.start(SamplingParams(), 0, None, StaysConnected())  # type: ignore[arg-type]
            await final_outputs(run, StaysConnected())  # type: ignore[arg-type]

    asyncio.run(main())
    first, second = (s.request_id for s in client.specs)
    assert first != second
    assert "cmpl-1" not in first + second
    assert [run.request_id for run in runs] == ["cmpl-1", "cmpl-1"]


def test_a_request_that_failed_in_the_engine_is_a_request_failed_error() -> None:
    """A final snapshot carrying an error becomes RequestFailedError (HTTP 500)."""
    client = ScriptedClient({1: ["a", "ab"]}, error="RuntimeError: boom")
    run = make_run(client, [(1,)])

    async def main() -> None:
        await run.start(SamplingParams(), 0, None, StaysConnected())  # type: ignore[arg-type]
        await final_outputs(run, StaysConnected())  # type: ignore[arg-type]

    with pytest.raises(RequestFailedError, match="RuntimeError: boom"):
        asyncio.run(main())


def test_a_stream_sends_each_delta_then_done() -> None:
    """The SSE body carries one chunk per new text and ends with [DONE]."""
    client = ScriptedClient({1: ["a", "ab", "abc"]})
    run = make_run(client, [(1,)])

    def chunk(index: int, choice: CompletionOutput, delta: tuple[str, int, int, bool]) -> dict:
        return {"index": index, "text": delta[0], "done": delta[3]}

    async def main() -> list[str]:
        await run.start(SamplingParams(), 0, None, StaysConnected())  # type: ignore[arg-type]
        response = stream_response(run, 1, chunk, None)
        return [part async for part in response.body_iterator]  # type: ignore[misc]

    parts = asyncio.run(main())
    assert [json.loads(p[6:]) for p in parts[:-1]] == [
        {"index": 0, "text": "a", "done": False},
        {"index": 0, "text": "b", "done": False},
        {"index": 0, "text": "c", "done": True},
    ]
    assert parts[-1] == "data: [DONE]\n\n"


def test_a_client_that_leaves_while_queued_aborts_before_any_output() -> None:
    """Both prompts still wait for their first output when the client goes: the wait ends
    with ClientDisconnectedError (a 499 nobody reads, not a server error in the log) and both
    streams are closed (the engine aborts them unscheduled)."""
    client = ScriptedClient({1: [], 2: []})
    run = make_run(client, [(1,), (2,)])
    with pytest.raises(ClientDisconnectedError, match="the client closed the connection"):
        # Bounded: were the disconnect missed, this would end in TimeoutError, not hang.
        start = run.start(SamplingParams(), 0, None, LeavesAfter(2))  # type: ignore[arg-type]
        asyncio.run(asyncio.wait_for(start, timeout=5))
    assert sorted(client.closed_early) == sorted(s.request_id for s in client.specs)
    assert len(client.closed_early) == 2
