"""The runner's adapters: the registered names and paths, those in host memory (host_set.py:
least recently used out past `max_cpu_loras`, read back between steps when next asked for), and
before each step the slots its adapters take and its tokens' groups."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from blockserve.config import LoRAConfig
from blockserve.kernels import CpuKernels
from blockserve.lora.adapter import LoRAAdapter, LoRAError, load_adapter, read_in_parts
from blockserve.lora.host_set import HostAdapters
from blockserve.lora.layers import (
    TORCH_PRODUCTS,
    CpuProducts,
    LoRAProducts,
    LoRASlots,
    LoRAStep,
    TritonProducts,
    wrap_projections,
)
from blockserve.lora.registry import AdapterRegistry
from blockserve.model.arch import LlamaArchConfig
from blockserve.sched.output import ScheduledRequest


class LoRAManager:
    def __init__(
        self,
        config: LoRAConfig,
        arch: LlamaArchConfig,
        dtype: torch.dtype,
        slots: LoRASlots,
        step: LoRAStep,
    ) -> None:
        self.config, self.arch, self.dtype = config, arch, dtype
        self.slots, self.step = slots, step
        self.registry = AdapterRegistry()  # what is served: name -> path, read anywhere
        # Each (name, path) ever served here, with the content digests it has held in turn:
        # a name pointed again at a path whose files changed hashes its blocks apart.
        self._versions: dict[tuple[str, str], list[str]] = {}
        self._hash_paths: dict[str, str] = {}
        self._identities: dict[str, bytes] = {}
        self.host = HostAdapters(config.host_capacity, self._parts)
        self._slot_used: list[int] = [0] * config.max_loras  # the step that last used each
        self._steps = 0

    def register(self, name: str, path: str) -> None:
        """Read and check the adapter now (LoRAError when it cannot be served)."""
        self.add(self.read(name, path))

    def read(self, name: str, path: str) -> LoRAAdapter:
        """The adapter at `path`, checked against this model (any thread may read one)."""
        return load_adapter(name, path, self.arch, self.config.max_lora_rank, self.dtype)

    def _parts(self, name: str, path: str) -> Iterator[LoRAAdapter | None]:
        """A read back into host memory: LoRAError at its end if the files now hold other
        content than the one served (its blocks are keyed by that content)."""
        for part in read_in_parts(name, path, self.arch, self.config.max_lora_rank, self.dtype):
            served = self._identities.get(name)
            if (
                part is not None
                and served is not None
                and bytes.fromhex(part.digest)[:16] != served
            ):
                raise LoRAError(
                    f"LoRA adapter {name!r} ({path}): its files changed since it was loaded; "
                    "load it again to serve them"
                )
            yield part

    def add(self, adapter: LoRAAdapter) -> None:
        """Serve an adapter already read (between steps: it may replace one in a slot)."""
        name = adapter.name
        self.registry.add(name, adapter.path)
        versions = self._versions.setdefault((name, adapter.path), [])
        if adapter.digest not in versions:
            versions.append(adapter.digest)
        generation = versions.index(adapter.digest)
        # vLLM's key is (name, path); other content at a path served before gets its own.
        self._hash_paths[name] = adapter.path + (f"#{generation}" if generation else "")
        self._identities[name] = bytes.fromhex(adapter.digest)[:16]
        self.host.drop(name)  # an older version's read, if one is under way
        self.host.keep(adapter)
        if name in self.slots.resident:  # a new version under a known name
            self.slots.install(adapter, self.slots.resident.index(name))

    def serves(self, name: str) -> bool:
        """Whether `name` is registered now (a request checked earlier may outlive it)."""
        return name in self.registry

    def hash_path(self, name: str) -> str:
        """The path that enters the block hashes of `name`'s requests: the path it was loaded
        from, as vLLM hashes it, with `#N` after it for the Nth other content seen there (so
        blocks computed with replaced weights are never read). `name` must be served."""
        return self._hash_paths[name]

    def identity(self, name: str) -> bytes:
        """The content digest of the adapter served as `name` (it must be served): what
        keys its blocks in the tiers below the device."""
        return self._identities[name]

    def unregister(self, name: str) -> None:
        self.registry.remove(name)
        self._hash_paths.pop(name)
        self._identities.pop(name)
        self.host.drop(name)
        if name in self.slots.resident:
            self.slots.resident[self.slots.resident.index(name)] = None

    def ready(self, name: str) -> bool:
        """Whether a step can take `name` now: in a slot or in host memory. If neither, its
        read starts on the reading thread (the scheduler leaves its requests waiting)."""
        if name in self.slots.resident:
            return True
        path = self.registry.get(name)  # None: unloaded (the engine refuses its new requests)
        return path is not None and self.host.request(name, path)

    def between_steps(self) -> dict[str, str]:
        """Advance the reads under way; the adapters whose read failed since last asked, each
        with the reason (their requests fail; the next request for one reads it again)."""
        self.host.advance()
        failed, self.host.failed = self.host.failed, {}
        return failed

    def begin_step(
        self, scheduled: Sequence[ScheduledRequest], lora_of: Callable[[str], str | None]
    ) -> None:
        """Slots for the step's adapters (at most `max_loras`: the scheduler's bound) and
        the rows of each adapter's tokens in the step's flat batch."""
        self._steps += 1
        rows: dict[str, list[int]] = {}
        start = 0
        for request in scheduled:
            name = lora_of(request.request_id)  # type: ignore[arg-type]
            if name is not None:
                rows.setdefault(name, []).extend(range(start, start + len(request.token_ids)))
            start += len(request.token_ids)
        groups = sorted((self._slot_for(name, set(rows)), r) for name, r in rows.items())
        for slot, _ in groups:
            self._slot_used[slot] = self._steps
        self._set_layout(groups)

    def _set_layout(self, groups: list[tuple[int, list[int]]]) -> None:
        """The step's [G, width] layout of its adapter tokens (LoRAStep)."""
        step = self.step
        if not groups:
            step.slots = step.src = step.dest = None
            return
        device = self.slots.a[0, "qkv_proj"].device
        width = max(len(r) for _, r in groups)
        src = [row for _, r in groups for row in r]
        dest = [g * width + i for g, (_, r) in enumerate(groups) for i in range(len(r))]
        slots = [slot for slot, _ in groups]
        step.slots = torch.tensor(slots, device=device)
        sizes = [len(r) for _, r in groups]
        step.starts = torch.tensor([sum(sizes[:g]) for g in range(len(sizes) + 1)], device=device)
        step.src = torch.tensor(src, device=device)
        step.dest = None if len(dest) == len(groups) * width else torch.tensor(dest, device=device)
        step.width = width
        step.all_slots = slots == list(range(len(self.slots.resident)))

    def _slot_for(self, name: str, needed: set[str]) -> int:
        resident = self.slots.resident
        if name in resident:
            return resident.index(name)
        free = [s for s, held in enumerate(resident) if held is None or held not in needed]
        if not free:
            raise LoRAError(f"a step holds more adapters than --max-loras {len(resident)}")
        slot = min(free, key=lambda s: (resident[s] is not None, self._slot_used[s]))
        self.slots.install(self._adapter(name), slot)
        return slot

    def _adapter(self, name: str) -> LoRAAdapter:
        adapter = self.host.get(name)
        if adapter is None:  # left host memory after the scheduler found it there
            adapter = self.host.read_now(name, self.registry[name])
        return adapter


def build_lora_manager(
    config: LoRAConfig | None,
    model: nn.Module,
    arch: LlamaArchConfig,
    dtype: torch.dtype,
    device: torch.device,
    kernels: CpuKernels | None = None,
) -> LoRAManager | None:
    """The adapters' slot pool over `model`'s wrapped projections, --lora-modules read and
    checked; None without --enable-lora. `kernels`: our CPU kernels (a CPU runner's)."""
    if config is None:
        return None
    slots = LoRASlots(
        arch=arch,
        max_loras=config.max_loras,
        max_rank=config.max_lora_rank,
        dtype=dtype,
        device=device,
    )
    step = wrap_projections(model, arch, slots, lora_products(device, kernels))
    manager = LoRAManager(config=config, arch=arch, dtype=dtype, slots=slots, step=step)
    for name, path in config.modules:
        manager.register(name, path)
    return manager


def lora_products(device: torch.device, kernels: CpuKernels | None) -> LoRAProducts:
    """The grouped products for `device`, chosen once: one Triton launch a projection on CUDA;
    on a CPU ours once loaded (`kernels`, the runner's), torch's before (and without them)."""
    if device.type == "cuda":
        from blockserve.kernels.triton_lora import add_lora

        return TritonProducts(add_lora)
    return TORCH_PRODUCTS if kernels is None else CpuProducts(kernels)
