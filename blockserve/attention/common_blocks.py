"""A shared prefix's common blocks, packed once for our prefix kernel and kept across steps."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

# What the kept packings may hold in all: the default model's 30 layers keep 24 MB for a
# 1,024-token prefix. Past it, a layer's blocks are packed for each call, as without this.
MAX_BYTES = 256 << 20

BlockSet = tuple[int, ...]


class PackedCommonBlocks:
    """Per block set and layer (its KV cache tensor), `pack_common`'s result.

    Every decode step of sequences that share a cached prefix attends to the same common blocks
    (shared_prefix.py). Our kernel reads K and V in its own layout, which it packs from the
    paged cache on every call (docs/cpu-kernels.md). This keeps each layer's packed blocks
    (`pack_common`) from one step to the next while the blocks stay the same and nothing writes
    into them.

    A block's K and V change only when something writes into it: a step's forward, at the slots
    of its slot mapping, or a writer outside the forward (the KV tiers' loads), which must call
    `forget`. `begin_step` (each step's plan, before its forward) drops every kept block set
    that the step does not use or that its slot mapping writes into, and everything after a
    `forget`. A block set is one plan's common blocks, in order; a step uses at most two (its
    decodes' and its prefill chunks' on a shared prefix).
    """

    def __init__(self, max_bytes: int = MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        # block set → {a layer's cache data_ptr: (that cache, its packing)}: the weak
        # reference tells a cache freed and another allocated at its address apart
        self._kept: dict[BlockSet, dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]]] = {}
        self._bytes = 0
        self._forgets = 0  # counted by `forget` (any thread), acted on by `begin_step`
        self._forgets_seen = 0
        self.packs = 0  # layers packed, and layers served from what was kept: for tests and
        self.reuses = 0  # benchmarks

    def forget(self) -> None:
        """Something outside the forward wrote into the KV caches: keep nothing from before.
        Safe from any thread: takes effect at the next `begin_step`."""
        self._forgets += 1

    def begin_step(self, slot_mapping: torch.Tensor, block_size: int, used: list[BlockSet]) -> None:
        """Before a step's forward: keep only the block sets it uses (`used`) that its own K/V
        writes (`slot_mapping`) leave alone."""
        if self._forgets != self._forgets_seen:
            self._forgets_seen = self._forgets
            self._drop(list(self._kept))
        written: set[int] = set()  # the blocks the step writes into, if any kept set is used
        if any(block_set in used for block_set in self._kept):
            written = set(torch.div(slot_mapping, block_size, rounding_mode="floor").tolist())
        self._drop([s for s in self._kept if s not in used or not written.isdisjoint(s)])

    def get(
        self,
        pack: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
        kv_cache: torch.Tensor,
        block_set: BlockSet,
        block_ids: torch.Tensor,
    ) -> torch.Tensor:
        """`pack` (our `pack_common`) of `block_ids` (whose tuple is `block_set`) in this
        layer's cache: kept from an earlier step if it was packed there, else packed now (and
        kept if it fits under `max_bytes`)."""
        layers = self._kept.get(block_set)
        key = kv_cache.data_ptr()
        if layers is not None and key in layers:
            cache, packed = layers[key]
            if cache() is kv_cache:
                self.reuses += 1
                return packed
            del layers[key]  # another cache's, gone, that lay at the same address
            self._bytes -= _size(packed)
        packed = pack(kv_cache[0], kv_cache[1], block_ids)
        self.packs += 1
        if self._bytes + _size(packed) <= self.max_bytes:
            layers = self._kept.setdefault(block_set, {})
            layers[key] = (weakref.ref(kv_cache), packed)
            self._bytes += _size(packed)
        return packed

    def _drop(self, block_sets: list[BlockSet]) -> None:
        for block_set in block_sets:
            layers = self._kept.pop(block_set)
            self._bytes -= sum(_size(packed) for _, packed in layers.values())


def _size(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
