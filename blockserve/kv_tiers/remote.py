"""`RemoteStore`: blocks in a Redis-protocol store every replica shares, keyed by block hash in
a namespace of the manifest fingerprint; the store bounds and evicts itself. A fault changes
speed, never an answer (marked down, a miss, retried with backoff); with a shared secret only
signed records are believed, and no value is read past a record's size."""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from urllib.parse import parse_qsl, urlencode, urlsplit

import torch

from blockserve.kv_tiers.store import (
    RECORD_HEADER,
    BlockShape,
    Read,
    Write,
    check_block,
    pack_block,
    unpack_block,
)

logger = logging.getLogger(__name__)

LOOKUP_TIMEOUT_S = 0.01  # a lookup on the engine thread waits at most this for the store
IO_TIMEOUT_S = 2.0  # reads and writes, on the tiers' own threads
FIRST_BACKOFF_S, MAX_BACKOFF_S = 0.5, 30.0
KNOWN = 1 << 16  # keys remembered as in the store (written or read here)
TAG_BYTES = 32  # HMAC-SHA256 of a signed record, after it


class RemoteStore:
    """The shared tier's store (a `SharedStore`) on a Redis-protocol server: `contains_many`
    (one round trip, engine thread), `get` and `put` (the tiers' loader and writer threads).
    No LRU of its own, no capacity: the server's settings are the bound; `used_bytes` counts
    what this process wrote.

    `secret`: records carry HMAC-SHA256(secret, key || record) after them, the key holding
    the namespace, so a record copied onto another key, or rewritten with a fresh checksum by
    someone without the secret, fails: a miss, deleted. None: whoever can write the store is
    trusted (said once in the log). Either way a value of any other length than a record's is
    never read: the lookup asks for lengths, a read for the record's bytes at most."""

    def __init__(
        self,
        url: str,
        shape: BlockShape,
        namespace: str,
        clock: Callable[[], float] = time.monotonic,  # for the backoff (tests pass their own)
        secret: bytes | None = None,
    ) -> None:
        import redis

        self.url = redacted(url)  # what the logs name: no password
        self.shape, self.namespace, self._clock = shape, namespace, clock
        self.failures = 0  # calls that found the store down, slow or refusing
        self._prefix = f"blockserve:{namespace}:".encode()
        self._lookups = redis.Redis.from_url(
            url, socket_timeout=LOOKUP_TIMEOUT_S, socket_connect_timeout=LOOKUP_TIMEOUT_S
        )
        self._io = redis.Redis.from_url(
            url, socket_timeout=IO_TIMEOUT_S, socket_connect_timeout=IO_TIMEOUT_S
        )
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._backoff = FIRST_BACKOFF_S
        self._written = 0
        self._known: OrderedDict[bytes, None] = OrderedDict()
        self._secret = secret
        self.record_bytes = RECORD_HEADER.size + shape.nbytes + (TAG_BYTES if secret else 0)
        if secret is None:
            logger.warning(
                "KV remote tier %s: no --kv-remote-secret, so its records are not signed: "
                "whoever can write the store answers for every replica",
                self.url,
            )

    def known(self, key: bytes) -> bool:
        """Whether this process wrote or read `key` lately (no round trip: the write path asks
        it of every block a step fills)."""
        with self._lock:
            return key in self._known

    def _remember(self, key: bytes) -> None:
        with self._lock:
            self._known[key] = None
            self._known.move_to_end(key)
            if len(self._known) > KNOWN:
                self._known.popitem(last=False)

    def key(self, block_hash: bytes) -> bytes:
        return self._prefix + block_hash

    def check(self) -> str | None:
        """A PING, bounded by `IO_TIMEOUT_S`: None when the store answers, else the error."""
        try:
            self._io.ping()
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    @property
    def is_down(self) -> bool:
        with self._lock:
            return self._clock() < self._down_until

    @property
    def used_bytes(self) -> int:
        return self._written * self.shape.nbytes

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether the store holds a record of a block's length at each key: one pipelined
        round trip, bounded by `LOOKUP_TIMEOUT_S`; all False while the store is down or when
        it does not answer."""
        if not keys or self.is_down:
            return [False] * len(keys)
        try:
            pipe = self._lookups.pipeline(transaction=False)
            for key in keys:
                pipe.strlen(self.key(key))
            found = [n == self.record_bytes for n in pipe.execute()]
        except Exception as exc:
            self._failed(exc)
            return [False] * len(keys)
        self._answered()
        return found

    def get(self, key: bytes) -> Read:
        if self.is_down:
            return Read()
        try:  # the length, and at most a record's bytes: a huge value is never read whole
            pipe = self._io.pipeline(transaction=False)
            pipe.strlen(self.key(key))
            pipe.getrange(self.key(key), 0, self.record_bytes - 1)
            length, data = pipe.execute()
        except Exception as exc:
            self._failed(exc)
            return Read()
        self._answered()
        if not length:  # absent; the client decodes no responses
            return Read()
        payload, reason = self._open(key, data, length)
        if payload is None:
            logger.warning("KV remote tier: a block %s; deleted, its tokens computed", reason)
            self._delete(key)
            return Read(damaged=True)
        self._remember(key)
        return Read(torch.frombuffer(payload, dtype=self.shape.dtype).view(self.shape.shape))

    def put(self, key: bytes, block: torch.Tensor) -> Write:
        """Write `block` unless the store holds the key (another replica wrote it); nothing is
        evicted here (the store's policy evicts)."""
        check_block(self.shape, block)
        if self.is_down:
            return Write()
        payload = block.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
        record = pack_block(payload)
        if self._secret is not None:
            record += self._tag(key, record)
        try:
            stored = bool(self._io.set(self.key(key), record, nx=True))
        except Exception as exc:
            self._failed(exc)
            return Write()
        self._answered()
        self._remember(key)  # written now, or another replica had written it
        if stored:
            self._written += 1
        return Write(stored=stored)

    def _tag(self, key: bytes, record: bytes | bytearray) -> bytes:
        return hmac.new(self._secret or b"", self.key(key) + record, hashlib.sha256).digest()

    def _open(self, key: bytes, data: bytes, length: int) -> tuple[bytearray | None, str]:
        """The block's bytes from a record read at `key`, or None and what is wrong."""
        if length != self.record_bytes or len(data) != self.record_bytes:
            return None, f"is {length} bytes, not a record's {self.record_bytes}"
        if self._secret is not None:
            record, tag = memoryview(data)[:-TAG_BYTES], data[-TAG_BYTES:]
            if not hmac.compare_digest(self._tag(key, record.tobytes()), tag):
                return None, "fails its signature (written without the shared secret)"
            data = data[:-TAG_BYTES]
        return unpack_block(data, self.shape.nbytes)

    def close(self) -> None:
        self._lookups.close()
        self._io.close()

    def _delete(self, key: bytes) -> bool:
        with self._lock:
            self._known.pop(key, None)
        try:
            return bool(self._io.delete(self.key(key)))
        except Exception as exc:
            self._failed(exc)
            return False

    def _failed(self, exc: Exception) -> None:
        """Mark the tier down for the current backoff (doubling up to `MAX_BACKOFF_S`); the
        first failure of an outage is logged."""
        with self._lock:
            self.failures += 1
            first = self._backoff == FIRST_BACKOFF_S
            self._down_until = self._clock() + self._backoff
            self._backoff = min(2 * self._backoff, MAX_BACKOFF_S)
        if first:
            logger.warning(
                "KV remote tier %s is down (%s: %s); serving from the other tiers, retrying "
                "with backoff",
                self.url,
                type(exc).__name__,
                exc,
            )

    def _answered(self) -> None:
        with self._lock:
            recovered = self._backoff != FIRST_BACKOFF_S
            self._backoff = FIRST_BACKOFF_S
        if recovered:
            logger.info("KV remote tier %s answers again", self.url)


def redacted(url: str) -> str:
    """`url` with its password, in the address or as a `password=` query parameter (which
    redis-py reads too), replaced by ***."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:  # not a URL that parses: nothing of it is shown
        return "<a URL that does not parse>"
    shown = url
    if password is not None:
        at = parts.netloc.rindex("@")
        user = parts.netloc[:at].partition(":")[0]
        shown = shown.replace(parts.netloc, f"{user}:***@{parts.netloc[at + 1 :]}", 1)
    if parts.query:
        query = parse_qsl(parts.query, keep_blank_values=True)
        hidden = [(k, "***" if k.lower() == "password" else v) for k, v in query]
        shown = shown.replace(f"?{parts.query}", f"?{urlencode(hidden, safe='*')}", 1)
    return shown
