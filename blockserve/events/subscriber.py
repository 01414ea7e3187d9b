"""Following a server's KV events: gap detection, replay, and a mirror of its cached hashes."""

from __future__ import annotations

from collections.abc import Iterable

import msgspec
import zmq

from blockserve.core.events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVEventBatch,
    decode_batch,
)
from blockserve.events.zmq_publisher import END_SEQ


class ReplayUnavailableError(RuntimeError):
    """A gap could not be filled: no replay endpoint, or the batches left the buffer.

    `resume_seq`: where the subscriber stands after a failed gap fill in `poll` (the batch
    that revealed the gap, still replayable); what came before it is lost to this subscriber,
    so a mirror built from it must be rebuilt (cleared) before going on."""

    def __init__(self, message: str, resume_seq: int | None = None) -> None:
        super().__init__(message)
        self.resume_seq = resume_seq


class KVEventSubscriber:
    """Receives `(seq, batch)` in order from a publisher's PUB (and ROUTER) sockets.

    `KVEventSubscriber` yields batches strictly in sequence order, without duplicates: when a
    sequence number is skipped (a late join, a dropped message) it asks the replay socket for
    the missing batches first. `CacheMirror` applies batches to a set of hashes — the per-server
    index a KV-aware router keeps.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        start_seq: int = 0,
        replay_timeout_ms: int = 2000,
    ) -> None:
        self._context = zmq.Context()
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.connect(endpoint)
        self._replay: zmq.Socket | None = None
        if replay_endpoint is not None:
            self._replay = self._context.socket(zmq.DEALER)
            self._replay.set_hwm(0)  # a replay may be the whole buffer: never drop any of it
            self._replay.connect(replay_endpoint)
        self.next_seq = start_seq
        self.replay_timeout_ms = replay_timeout_ms
        self.num_replayed = 0

    def poll(self, timeout_ms: int = 100) -> list[tuple[int, KVEventBatch]]:
        """The batches available within `timeout_ms`, in order, gaps filled by replay."""
        batches: list[tuple[int, KVEventBatch]] = []
        timeout = timeout_ms
        while self._sub.poll(timeout):
            timeout = 0
            _topic, seq_bytes, payload = self._sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if seq < self.next_seq:
                continue  # already delivered (through replay)
            if seq > self.next_seq:
                try:
                    batches.extend(self.replay(self.next_seq, until=seq))
                except ReplayUnavailableError as exc:
                    self.next_seq = seq
                    raise ReplayUnavailableError(str(exc), resume_seq=seq) from None
            batches.append((seq, decode_batch(payload)))
            self.next_seq = seq + 1
        return batches

    def replay(self, start: int, until: int | None = None) -> list[tuple[int, KVEventBatch]]:
        """Fetch buffered batches from `start` (up to `until`, exclusive) through replay."""
        if self._replay is None:
            raise ReplayUnavailableError(
                f"batches {start}.. were missed and no replay endpoint is set"
            )
        self._replay.send_multipart([b"", start.to_bytes(8, "big")])
        received: list[tuple[int, KVEventBatch]] = []
        while True:
            if not self._replay.poll(self.replay_timeout_ms):
                raise ReplayUnavailableError("the replay socket did not answer")
            *_, seq_bytes, payload = self._replay.recv_multipart()
            if seq_bytes == END_SEQ:
                break
            seq = int.from_bytes(seq_bytes, "big")
            if seq >= self.next_seq and (until is None or seq < until):
                received.append((seq, decode_batch(payload)))
                self.next_seq = seq + 1
        missing = until is not None and len(received) != until - start
        if missing or (received and received[0][0] != start):
            raise ReplayUnavailableError(f"batches from {start} are no longer in the replay buffer")
        self.num_replayed += len(received)
        return received

    def close(self) -> None:
        self._sub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._context.term()


class CacheMirror:
    """The block hashes one server holds, rebuilt from its events, per medium.

    `hashes` is the device tier (medium "GPU", or no medium: vLLM's events before tiers);
    `lower` holds each lower tier's hashes ("CPU", "DISK"). A hash is held while any tier
    holds it. Its size is bounded by the server's own capacity: it holds nothing the server
    does not.
    """

    def __init__(self) -> None:
        self.hashes: set[ExternalBlockHash] = set()
        self.lower: dict[str, set[ExternalBlockHash]] = {}

    def __contains__(self, block_hash: object) -> bool:
        if block_hash in self.hashes:
            return True
        return any(block_hash in tier for tier in self.lower.values())

    def __len__(self) -> int:
        return len(self.hashes) + sum(len(tier) for tier in self.lower.values())

    def apply(self, batches: Iterable[KVEventBatch]) -> None:
        for batch in batches:
            for event in batch.events:
                if isinstance(event, BlockStored):
                    self._tier(event.medium).update(event.block_hashes)
                elif isinstance(event, BlockRemoved):
                    self._tier(event.medium).difference_update(event.block_hashes)
                elif isinstance(event, AllBlocksCleared):
                    # A prefix-cache reset empties the device pool; lower tiers keep their
                    # blocks (and say so with their own BlockRemoved events when they drop any).
                    self.hashes.clear()

    def clear(self) -> None:
        """Forget everything: the server is gone, or its stream cannot be recovered."""
        self.hashes.clear()
        self.lower.clear()

    def _tier(self, medium: str | None) -> set[ExternalBlockHash]:
        if medium is None or medium == MEDIUM_GPU:
            return self.hashes
        return self.lower.setdefault(medium, set())


def format_event(seq: int, batch: KVEventBatch, event: object, as_json: bool) -> str:
    """One line for `blockserve events`: JSON (bytes as base64) or a short summary."""
    if as_json:
        record = {
            "seq": seq,
            "ts": batch.ts,
            "data_parallel_rank": batch.data_parallel_rank,
            "event": event,
        }
        return msgspec.json.encode(record).decode()
    if isinstance(event, BlockStored):
        return (
            f"seq={seq} BlockStored blocks={len(event.block_hashes)} "
            f"hashes={event.block_hashes} parent={event.parent_block_hash!r} "
            f"tokens={len(event.token_ids)} block_size={event.block_size} "
            f"medium={event.medium} lora={event.lora_name}"
        )
    if isinstance(event, BlockRemoved):
        return f"seq={seq} BlockRemoved hashes={event.block_hashes} medium={event.medium}"
    return f"seq={seq} {type(event).__name__}"
