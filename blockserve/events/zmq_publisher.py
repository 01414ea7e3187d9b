"""`ZmqEventPublisher`: KV event batches on a ZMQ PUB socket, with a ROUTER replay socket."""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import threading
from collections import deque
from urllib.parse import urlsplit

import zmq

from blockserve.core.events import KVEventBatch, encode_batch
from blockserve.events.config import KVEventsConfig

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_POLL_MS = 50
_STOP = None


def binds(endpoint: str) -> bool:
    """vLLM's rule: wildcard, IPv6-any, ipc and inproc endpoints are bound, others connected."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def nobody_listens(endpoint: str) -> bool:
    """A tcp:// endpoint where nothing accepts a connection now: a publisher that connects
    there sends every event to nowhere until a subscriber binds it."""
    parts = urlsplit(endpoint)
    if parts.scheme != "tcp" or parts.hostname is None or parts.port is None:
        return False
    try:
        socket.create_connection((parts.hostname, parts.port), timeout=1.0).close()
    except OSError:
        return True
    return False


def log_endpoint(endpoint: str) -> None:
    """Say at start where the events go; loudly when they would go nowhere."""
    if binds(endpoint):
        logger.info("KV events: the publisher binds %s; subscribers connect to it", endpoint)
    elif nobody_listens(endpoint):
        port = endpoint.rsplit(":", 1)[-1]
        logger.warning(
            "KV events: %s names a host, so the publisher connects to it (vLLM's rule) and "
            "nothing listens there: events are dropped until a subscriber binds it. For "
            "subscribers to connect to this server, use tcp://*:%s",
            endpoint,
            port,
        )
    else:
        logger.info("KV events: the publisher connects to the subscriber bound at %s", endpoint)


class ZmqEventPublisher:
    """Wire format (vLLM's): multipart `[topic, seq as 8-byte big-endian, msgpack payload]`, seq
    from 0 and +1 per batch. Replay: a client sends an 8-byte big-endian start seq (behind an
    empty delimiter frame, as REQ sockets send it) and receives `[seq, payload]` for every
    buffered batch from there, then `[-1 as signed 8 bytes, b""]`.

    The engine step never waits on the network: `publish` numbers and encodes the batch, keeps
    it in the replay buffer, and hands it to a background thread through a bounded queue. When
    that queue is full the batch is not sent live, but stays replayable: a subscriber sees the
    gap in sequence numbers and fills it through replay.
    """

    def __init__(self, config: KVEventsConfig) -> None:
        self.config = config
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay: zmq.Socket | None = None
        try:
            if binds(config.endpoint):
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            log_endpoint(config.endpoint)
            if config.replay_endpoint is not None:
                logger.info("KV events: missed batches replayed on %s", config.replay_endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                # A ROUTER silently drops what exceeds its high-water mark: a replay of the
                # whole buffer (bounded by buffer_steps) must go out whole.
                self._replay.set_hwm(0)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError:
            self._close_sockets(linger=0)
            raise
        # The endpoints actually used (a `:0` port resolved), read before the thread owns
        # the sockets: zmq sockets must not be touched from two threads.
        self.endpoint = str(self._pub.getsockopt_string(zmq.LAST_ENDPOINT))
        self.replay_endpoint = (
            None if self._replay is None else str(self._replay.getsockopt_string(zmq.LAST_ENDPOINT))
        )
        self._topic = config.topic.encode()
        self._queue: queue.Queue[tuple[int, bytes] | None] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._buffer_lock = threading.Lock()
        self._next_seq = 0
        self.num_dropped_live = 0
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()

    def publish(self, batch: KVEventBatch) -> None:
        """Number, encode and buffer the batch; queue it for sending. Never blocks."""
        seq = self._next_seq
        self._next_seq += 1
        payload = encode_batch(batch)
        with self._buffer_lock:
            self._buffer.append((seq, payload))
        try:
            self._queue.put_nowait((seq, payload))
        except queue.Full:
            self.num_dropped_live += 1
            if self.num_dropped_live == 1 or self.num_dropped_live % 1000 == 0:
                logger.warning(
                    "KV event queue full: %d batches not sent live (replayable)",
                    self.num_dropped_live,
                )

    def shutdown(self, timeout: float = 2.0) -> None:
        """Send what is queued (for up to `timeout`), stop the thread, close the sockets."""
        self._stopping.set()
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(_STOP)
        self._thread.join(timeout)
        if self._thread.is_alive():  # sockets belong to the thread until it ends
            logger.warning("KV event publisher still draining after %.1fs; leaving it", timeout)
            return
        self._close_sockets(linger=int(timeout * 1000))
        self._context.term()

    def _close_sockets(self, linger: int) -> None:
        self._pub.close(linger=linger)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        while True:
            if self._replay is not None:
                while self._replay.poll(0):
                    self._serve_replay()
            try:
                item = self._queue.get(timeout=_POLL_MS / 1000)
            except queue.Empty:
                if self._stopping.is_set():
                    return
                continue
            if item is _STOP:
                return
            seq, payload = item
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except zmq.ZMQError:  # a send failure loses this live copy; replay still has it
                logger.exception("KV event batch %d not sent", seq)

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        # [identity, b"", start] from REQ (or DEALER with a delimiter); [identity, start] without.
        identity, start_bytes = frames[0], frames[-1]
        envelope = [identity, b""] if len(frames) == 3 else [identity]
        if len(start_bytes) != 8:
            logger.warning("ignoring a replay request with a %d-byte start", len(start_bytes))
            return
        start = int.from_bytes(start_bytes, "big")
        with self._buffer_lock:
            batches = [(seq, payload) for seq, payload in self._buffer if seq >= start]
        for seq, payload in batches:
            self._replay.send_multipart([*envelope, seq.to_bytes(8, "big"), payload])
        self._replay.send_multipart([*envelope, END_SEQ, b""])
