"""Fair share of the sequence slots: one request (all its `n` samples, all its prompts: one
`group_id`) may hold at most `cap` slots while a request of another group waits. Owns only
the choice of whom to admit next and whom to preempt for a waiting group; the scheduler acts."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from blockserve.sched.request import Request


class FairShare:
    """`cap = max(1, floor(share × max_num_seqs))`; share 1 leaves admission FCFS (and costs
    nothing). `held` counts each group's running samples: the scheduler counts it once a step
    (`held_by`) and adds each request it admits.

    vLLM admits strictly first come, first served, so one `n=128` request takes every slot until
    its samples finish. Here a group over its share is passed over at admission, and when every
    slot is taken its newest sample is preempted (recompute: it runs again when slots free).
    """

    def __init__(self, max_num_seqs: int, share: float) -> None:
        self.max_num_seqs = max_num_seqs
        self.cap = max(1, int(share * max_num_seqs))
        self.enabled = self.cap < max_num_seqs

    def held_by(self, *holders: Iterable[Request]) -> Counter[str]:
        """Sequence slots per group: one for each running (or loading) request."""
        if not self.enabled:
            return Counter()
        return Counter(request.group_id for requests in holders for request in requests)

    def next_to_admit(
        self, head: Request, waiting: Iterable[Request], held: Counter[str]
    ) -> Request:
        """The queue's `head` if its group is under its cap; else the first waiting request
        (queue order) whose group is, if one is; else the head, which may then take a slot
        that no other group asks for."""
        if not self.enabled or held[head.group_id] < self.cap:
            return head
        return next((r for r in waiting if held[r.group_id] < self.cap), head)

    def victim(
        self, waiting: Iterable[Request], running: Sequence[Request], held: Counter[str]
    ) -> Request | None:
        """When every slot is taken and a group under its cap waits: the newest running
        sample of the group that holds the most slots over its cap; else None."""
        if not self.enabled or sum(held.values()) < self.max_num_seqs:
            return None
        group, count = max(held.items(), key=lambda item: item[1])
        if count <= self.cap or not any(held[r.group_id] < self.cap for r in waiting):
            return None
        return next(r for r in reversed(running) if r.group_id == group)
