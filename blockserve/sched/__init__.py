"""Scheduling: requests, their queues and the continuous-batching scheduler. Imports no torch.

Modules:

  request.py     Request, RequestStatus
  queues.py      FCFS deque, priority heap, create_request_queue
  tier_loads.py  TierLoads: requests admitted LOADING while lower tiers copy their blocks in
  lpm.py         LpmQueue: longest cached prefix first with aging, matches kept current from the
                 pool's CacheListener calls
  scheduler.py   Scheduler: schedule(), update_from_output(), preemption, stops
  stops.py       check_stop: EOS, stop tokens, max_tokens, the context's end
  fair_share.py  FairShare: one request's samples and prompts hold at most a share of the slots
                 while another waits (whom to admit, whom to preempt)
  output.py      SchedulerOutput, ScheduledRequest, ModelRunnerOutput, RequestUpdate
  batch.py       what the runner is told each step (batch_for_runner); tokens in flight (async
                 scheduling) sent as placeholders
  encoder_cache.py  EncoderCacheManager: which images' vision-tower outputs the runner holds
                 (vLLM's rules), and which images a step encodes within its budget
"""

from __future__ import annotations

from blockserve.sched.request import Request, RequestStatus

__all__ = ["Request", "RequestStatus"]
