"""Random traffic through the real scheduler, device pool and KV tiers (host, disk, and a
remote tier on a real Redis server that the machine stops, restarts and damages, with their
threads), a fake runner writing KV that names its own prefix: no invariant breaks, no cached
or stored block ever holds another prefix's KV, and what the local tiers' events say they hold
is exactly what they hold."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from blockserve.bench.redis_server import RedisServer
from blockserve.config import SchedulerConfig
from blockserve.core.events import BlockRemoved, BlockStored, KVEventRecorder
from blockserve.core.hashing import BlockHash, BlockHasher, RequestBlockHasher
from blockserve.core.kv_cache_manager import KVCacheManager
from blockserve.engine.tier_feed import filled_blocks
from blockserve.kv_tiers.disk import DiskStore
from blockserve.kv_tiers.host import HostStore
from blockserve.kv_tiers.offload import KVTiers
from blockserve.kv_tiers.remote import MAX_BACKOFF_S, RemoteStore
from blockserve.kv_tiers.store import BlockShape, Tier
from blockserve.sampling_params import SamplingParams
from blockserve.sched.output import ModelRunnerOutput, SchedulerOutput
from blockserve.sched.request import Request, RequestStatus
from blockserve.sched.scheduler import Scheduler

BLOCK = 4
NUM_BLOCKS = 6  # 5 usable: the device evicts often, the tiers serve the rest
SHAPE = BlockShape(num_layers=1, block_size=BLOCK, num_kv_heads=1, head_dim=1, dtype=torch.float64)
HASHER = RequestBlockHasher(BlockHasher("sha256"), BLOCK)
PREFIXES = [list(range(9)), [*range(9), 50, 51, 52], [7] * 10, list(range(20, 33)), [5] * 12]


def kv_value(tokens: tuple[int, ...]) -> float:
    """The KV the fake runner writes at a position: a function of the prefix ending there."""
    return float(hash(tokens) % 1_000_003)


class TiersMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp())
        shape = (2, NUM_BLOCKS, BLOCK, 1, 1)
        self.kv = [torch.full(shape, -1.0, dtype=torch.float64)]
        host = Tier("host", "CPU", HostStore(SHAPE, 3 * SHAPE.nbytes))
        disk = Tier("disk", "DISK", DiskStore(self.root, SHAPE, 6 * SHAPE.nbytes))
        self.server = RedisServer(self.root)
        self.now = 0.0  # the remote store's clock: a restart moves it past any backoff
        self.remote = RemoteStore(self.server.url, SHAPE, "machine", clock=lambda: self.now)
        remote = Tier("remote", "REMOTE", self.remote)
        self.tiers = KVTiers(
            [host, disk], self.kv, BLOCK, events_hash_format="bytes", shared=remote
        )
        manager = KVCacheManager(NUM_BLOCKS, BLOCK, True, KVEventRecorder())
        config = SchedulerConfig(4, 16, max_model_len=(NUM_BLOCKS - 1) * BLOCK)
        self.scheduler = Scheduler(config, manager, (), self.tiers)
        self.prefixes: dict[BlockHash, tuple[int, ...]] = {}
        self.mirror: dict[str, set[bytes]] = {"CPU": set(), "DISK": set(), "REMOTE": set()}
        self.damaged: set[bytes] = set()  # disk or remote blocks a rule damaged: never KV
        self.next_id = 0

    def teardown(self) -> None:
        self.tiers.close()
        self.remote.close()
        self.server.stop()
        shutil.rmtree(self.root, ignore_errors=True)

    @rule(
        prefix=st.sampled_from(PREFIXES),
        suffix=st.lists(st.integers(0, 3), max_size=6),
        max_tokens=st.integers(1, 6),
    )
    def add_request(self, prefix: list[int], suffix: list[int], max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        request = Request(f"r{self.next_id}", prefix + suffix, params, HASHER)
        self.next_id += 1
        self.scheduler.add_request(request)

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(0, 3), max_size=6))
    def serve_to_the_end(self, prefix: list[int], suffix: list[int]) -> None:
        """One more request, then steps until nothing is left (finished requests leave cached
        blocks behind, which the next prompts evict down to the tiers)."""
        self.add_request(prefix, suffix, max_tokens=2)
        for _ in range(100):
            if not self.scheduler.has_unfinished_requests():
                return
            self.step(token=1)
        raise AssertionError("the requests did not finish in 100 steps")

    @precondition(lambda self: self.scheduler.has_unfinished_requests())
    @rule(token=st.integers(0, 3))
    def step(self, token: int) -> None:
        output = self.scheduler.schedule()
        if output.is_empty and self.scheduler.num_loading:
            self.tiers.wait_for_loads(1.0)
        self._execute(output)
        requests = self.scheduler.requests
        self.tiers.store(filled_blocks(output, requests, {}, BLOCK))
        sampled = {s.request_id: token for s in output.scheduled if s.sample}
        self.scheduler.update_from_output(output, ModelRunnerOutput(sampled))
        # Loads started this step end before the next one: the run is the same every time
        # (hypothesis replays it), and the invariants see no thread mid-way.
        assert self.tiers.flush(10.0)

    def _execute(self, output: SchedulerOutput) -> None:
        for scheduled in output.scheduled:
            tokens = self.scheduler.requests[scheduled.request_id].all_token_ids
            for offset in range(len(scheduled.token_ids)):
                position = scheduled.num_computed_tokens + offset
                block_id = scheduled.block_ids[position // BLOCK]
                value = kv_value(tuple(tokens[: position + 1]))
                self.kv[0][:, block_id, position % BLOCK] = value

    @precondition(lambda self: self.scheduler.requests)
    @rule(index=st.integers(0, 100))
    def abort_one(self, index: int) -> None:
        ids = list(self.scheduler.requests)
        self.scheduler.finish_requests([ids[index % len(ids)]], RequestStatus.FINISHED_ABORTED)

    @rule(index=st.integers(0, 100))
    def damage_a_disk_block(self, index: int) -> None:
        """Flip a byte of one block file: a load must stop there, and the store drop it."""
        assert self.tiers.flush(10.0)
        files = sorted((self.root / "blocks").glob("*/*.kv"))
        if files:
            path = files[index % len(files)]
            data = bytearray(path.read_bytes())
            data[-1] ^= 0x01
            path.write_bytes(bytes(data))
            self.damaged.add(bytes.fromhex(path.stem))

    @precondition(lambda self: self.server.process is not None)
    @rule()
    def stop_the_store(self) -> None:
        """The remote store goes away: lookups and loads find nothing there, writes drop."""
        assert self.tiers.flush(10.0)
        self.server.stop()

    @precondition(lambda self: self.server.process is None)
    @rule()
    def restart_the_store(self) -> None:
        """It comes back empty (no persistence), past any backoff."""
        self.server.start()
        self.now += MAX_BACKOFF_S

    @precondition(lambda self: self.server.process is not None)
    @rule(index=st.integers(0, 100))
    def damage_a_remote_block(self, index: int) -> None:
        assert self.tiers.flush(10.0)
        client = self.server.client()
        keys = sorted(client.keys(self.remote.key(b"") + b"*"))
        if keys:
            value = bytearray(client.get(keys[index % len(keys)]))  # type: ignore[arg-type]
            value[-1] ^= 0x01
            client.set(keys[index % len(keys)], bytes(value))
            self.damaged.add(keys[index % len(keys)][len(self.remote.key(b"")) :])

    def written_remote(self) -> set[bytes]:
        """What the remote store holds and this machine's tiers wrote (not damaged)."""
        if self.server.process is None:
            return set()
        prefix = self.remote.key(b"")
        held = {key[len(prefix) :] for key in self.server.client().keys(prefix + b"*")}
        return held - self.damaged

    def _expected(self, block_hash: bytes) -> torch.Tensor:
        tokens = self.prefixes[BlockHash(block_hash)]
        start = len(tokens) - BLOCK
        values = [kv_value(tokens[: start + k + 1]) for k in range(BLOCK)]
        return torch.tensor(values, dtype=torch.float64)

    @invariant()
    def sound(self) -> None:
        assert self.tiers.flush(10.0)
        for request in self.scheduler.requests.values():
            for index, block_hash in enumerate(request.block_hashes):
                self.prefixes[block_hash] = tuple(request.all_token_ids[: (index + 1) * BLOCK])
        manager = self.scheduler.kv_cache_manager
        assert manager.integrity_errors() == []
        for block_hash, block in manager.block_pool.cached_block_hash_to_block.items():
            if block_hash in self.prefixes:
                got = self.kv[0][0, block.block_id].flatten()
                assert torch.equal(got, self._expected(block_hash)), "a cached block's KV"
        for event in self.tiers.take_events():
            assert isinstance(event, (BlockStored, BlockRemoved)) and event.medium is not None
            hashes = {bytes(h) for h in event.block_hashes}  # type: ignore[arg-type]
            if isinstance(event, BlockStored):
                self.mirror[event.medium] |= hashes
            else:
                self.mirror[event.medium] -= hashes
        # The shared store evicts and restarts unannounced: its events are what was written.
        assert self.mirror["REMOTE"] >= self.written_remote()
        for tier in self.tiers.local:
            assert self.mirror[tier.medium] == set(tier.store.keys()), tier.name
            held = tier.store.keys()
            for key in held:
                if BlockHash(key) in self.prefixes and not (
                    tier.name == "disk" and key in self.damaged
                ):
                    block = tier.store.get(key).block
                    assert block is not None
                    assert torch.equal(block[0, 0].flatten(), self._expected(key)), tier.name
        if self.server.process is not None:  # every sound block in the store is its prefix's
            prefix = self.remote.key(b"")
            for key in self.server.client().keys(prefix + b"*"):
                block_hash = key[len(prefix) :]
                if BlockHash(block_hash) in self.prefixes and block_hash not in self.damaged:
                    block = self.remote.get(block_hash).block
                    assert block is not None and torch.equal(
                        block[0, 0].flatten(), self._expected(block_hash)
                    ), "remote"


TiersMachine.TestCase.settings = settings(
    max_examples=25,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_tiers_state_machine = TiersMachine.TestCase
test_tiers_state_machine.pytestmark = [pytest.mark.slow]  # ~20 s of real threads and files
