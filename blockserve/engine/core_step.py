"""A step as the engine core handles it: scheduled (`ScheduledStep`), run or launched and later
finished by the runner, each call turning a failure into the step's error, not the core's."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from blockserve.core.kv_cache_manager import RequestId
from blockserve.engine.outputs import EngineCoreOutputs, Started
from blockserve.lora.manager import LoRAManager
from blockserve.runner.start import LaunchedStep, ModelRunner
from blockserve.sched.output import ModelRunnerOutput, SchedulerOutput
from blockserve.sched.request import Request, RequestStatus
from blockserve.sched.scheduler import Scheduler

logger = logging.getLogger("blockserve.engine.core")
Ran = TypeVar("Ran")


@dataclass(frozen=True, slots=True)
class ScheduledStep:
    """A step as scheduled: the runner's batch, the samples it starts, when it was made."""

    output: SchedulerOutput
    started: tuple[Started, ...]
    now: float

    @classmethod
    def of(
        cls, scheduler_output: SchedulerOutput, requests: Mapping[RequestId, Request]
    ) -> ScheduledStep:
        started = tuple(
            (
                s.request_id,
                s.num_computed_tokens,
                requests[s.request_id].cache_explanation,
                requests[s.request_id].tier_cached_tokens,
            )
            for s in scheduler_output.scheduled
            if s.new_request is not None
        )
        return cls(scheduler_output, started, time.monotonic())


def run_step(run: Callable[[SchedulerOutput], Ran], scheduled: ScheduledStep) -> Ran | Exception:
    """`run` (the runner's execute, or launch) on the step; what it raised, logged."""
    try:
        return run(scheduled.output)
    except Exception as exc:  # the batch fails; the core goes on
        logger.exception(
            "model step failed; failing the %d requests in it", len(scheduled.output.scheduled)
        )
        return exc


def finish_step(
    runner: ModelRunner, launched: LaunchedStep | Exception
) -> ModelRunnerOutput | Exception:
    """A launched step's output, or why it has none."""
    if isinstance(launched, Exception):
        return launched
    try:
        return runner.finish(launched)
    except Exception as exc:
        logger.exception("model step failed when its tokens were read back")
        return exc


def advance_adapter_reads(lora: LoRAManager | None, scheduler: Scheduler) -> dict[RequestId, str]:
    """Between steps, LoRA adapters being read back into host memory advance; the waiting
    requests of one whose read failed (its files changed since) end, with the reason."""
    failed = lora.between_steps() if lora is not None else {}
    if not failed:
        return {}
    ids = [r.request_id for r in scheduler.waiting if r.lora_name in failed]
    ended = scheduler.finish_requests(ids, RequestStatus.FINISHED_ERROR)
    return {
        r.request_id: f"the LoRA adapter '{r.lora_name}' could not be read: {failed[r.lora_name]}"  # type: ignore[index]
        for r in ended
    }


def with_errors(outputs: EngineCoreOutputs, errors: dict[RequestId, str]) -> EngineCoreOutputs:
    """`outputs` with more failed samples (most steps have none: the outputs as they are)."""
    if not errors:
        return outputs
    return dataclasses.replace(outputs, errors={**outputs.errors, **errors})
