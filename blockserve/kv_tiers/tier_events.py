"""The KV events of the tiers below the device: one recorder per tier, with the tier's medium
("CPU", "DISK", and "REMOTE" for the blocks this replica wrote to the shared store), so that a
router knows what each replica can restore."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from blockserve.core.events import KVEvent, KVEventRecorder
from blockserve.core.hashing import BlockHash
from blockserve.kv_tiers.store import FilledBlock, Tier


class TierEvents:
    def __init__(
        self, tiers: Sequence[Tier[Any]], hash_format: str | None, block_size: int
    ) -> None:
        self.block_size = block_size
        self._lock = threading.Lock()
        self._recorders = {
            tier.name: KVEventRecorder(hash_format, tier.medium)  # type: ignore[arg-type]
            for tier in tiers
            if hash_format is not None
        }

    def stored(self, tier: Tier[Any], block_hash: BlockHash, block: FilledBlock | None) -> None:
        """A block promoted from disk to host has no FilledBlock: its event has no parent and
        no tokens (the hash is what a router indexes)."""
        recorder = self._recorders.get(tier.name)
        if recorder is None:
            return
        parent = block.parent_hash if block is not None else None
        tokens = list(block.token_ids) if block is not None else []
        lora = block.lora_name if block is not None else None
        extra_keys = [block.extra_keys] if block is not None else None
        with self._lock:
            recorder.block_stored([block_hash], parent, tokens, self.block_size, lora, extra_keys)

    def removed(self, tier: Tier[Any], keys: Sequence[bytes]) -> None:
        recorder = self._recorders.get(tier.name)
        if recorder is not None and keys:
            with self._lock:
                for key in keys:
                    recorder.block_removed(BlockHash(key))

    def take(self) -> list[KVEvent]:
        with self._lock:
            return [event for r in self._recorders.values() for event in r.take()]
