"""The pieces of a KV-event stream that a follower handles, apart from its
logic (``bindings/event_order.py``) and its thread (``bindings/events.py``):
a batch as received, the commit being built from batches in order, the
batches applied last (remembered byte for byte), the signal that the stream
belongs to a new publisher, the client side of vLLM's replay protocol, and
the ``with``-block behaviour every follower shares."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from kvhit.bindings.kv_events import END_SEQ, EventPlan

__all__ = [
    "PendingCommit",
    "PublisherRestart",
    "RecentBatches",
    "StopOnExit",
    "StreamMsg",
    "request_replay",
    "unbroken",
]


@dataclass(slots=True)
class StreamMsg:
    """One batch as it came, live or replayed: its sequence number and its
    payload bytes (ZMQ's own object, never copied)."""

    seq: int
    payload: bytes


@dataclass(slots=True)
class PendingCommit:
    """Batches decoded in order but not yet committed (``plan`` None: none,
    so a message's own plan is taken as it is, none made to merge into)."""

    plan: EventPlan | None = None
    batches: int = 0


class RecentBatches:
    """The batches applied last, seq -> payload bytes: at most ``max_count``
    of them and ``max_bytes`` of payload, except the newest, kept whatever
    its size (it anchors replays). A slotted holder of an ``OrderedDict``
    (oldest first): ``remember`` runs once a batch on the in-order path,
    where a subclass of the dict cost ~140 ns more a call."""

    __slots__ = ("batches", "max_count", "max_bytes", "nbytes", "last_evicted")

    def __init__(self, max_count: int, max_bytes: int) -> None:
        self.batches: OrderedDict[int, bytes] = OrderedDict()
        self.max_count, self.max_bytes = max_count, max_bytes
        self.nbytes = 0
        #: The seq of the last batch let go for the bounds (-1: none since
        #: forget): batches go oldest first, so every batch applied after it
        #: is still here to compare with.
        self.last_evicted = -1

    def remember(self, msg: StreamMsg) -> None:
        """Keep ``msg``'s bytes under its seq (newest), within the bounds."""
        batches = self.batches
        old = batches.pop(msg.seq, None)
        if old is not None:
            self.nbytes -= len(old)
        batches[msg.seq] = msg.payload
        self.nbytes += len(msg.payload)
        while len(batches) > 1 and (
            len(batches) > self.max_count or self.nbytes > self.max_bytes
        ):
            self.last_evicted, gone = batches.popitem(last=False)
            self.nbytes -= len(gone)

    def get(self, seq: int) -> bytes | None:
        """The payload applied at ``seq``, or None if not remembered."""
        return self.batches.get(seq)

    def __contains__(self, seq: object) -> bool:
        return seq in self.batches

    def __len__(self) -> int:
        return len(self.batches)

    def forget(self) -> None:
        """Remember nothing (the stream is a new publisher's)."""
        self.batches.clear()
        self.nbytes = 0
        self.last_evicted = -1


class PublisherRestart(Exception):
    """Raised inside a follower when the stream belongs to a new publisher."""


def unbroken(msgs: list[StreamMsg], start: int) -> bool:
    """Whether a replay's answer (sorted by seq) holds every seq from
    ``start`` to its last batch: no batch lost on the way, none missing at
    its front."""
    return all(m.seq == start + i for i, m in enumerate(msgs))


def request_replay(
    ctx: Any,
    endpoint: str,
    start: int,
    stop: int | None,
    timeout_s: float,
    stopping: threading.Event,
    parse: Callable[[list[bytes]], StreamMsg | None],
) -> list[StreamMsg] | None:
    """Ask the ROUTER at ``endpoint`` (vLLM's ``ZmqEventPublisher`` replay)
    for batches ``start..stop-1`` (all if ``stop`` is None), over a new
    DEALER of the pyzmq context ``ctx``; ``parse`` reads a replay frame list
    (None: not a batch).

    Returns the in-range messages received, sorted by seq, or None if the
    end marker did not arrive within ``timeout_s`` or ``stopping`` was set.
    A fresh DEALER per request keeps a late answer to an abandoned request
    from being read as the answer to this one.
    """
    import zmq  # here, so apply() and the types work without pyzmq

    dealer = ctx.socket(zmq.DEALER)
    try:
        dealer.setsockopt(zmq.LINGER, 0)
        # No receive limit: the answer is at most the publisher's buffer,
        # all of it kept in ``out`` anyway. With ZMQ's default (1000) a
        # reader slower than the ROUTER fills both pipes, and the ROUTER
        # then drops the rest of the answer and its end marker silently (a
        # 20,000-batch answer of 2 KB batches read after it was sent
        # arrived as 3,000 batches and no end marker; with no limit, whole).
        dealer.setsockopt(zmq.RCVHWM, 0)
        dealer.connect(endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out: list[StreamMsg] = []
        deadline = time.monotonic() + timeout_s
        while not stopping.is_set():
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not dealer.poll(min(left_ms, 100)):
                if left_ms <= 0:
                    return None
                continue
            frames = dealer.recv_multipart()
            if len(frames) == 4 and frames[2] == END_SEQ:
                break
            msg = parse(frames)
            if msg is None or msg.seq < start:
                continue
            if stop is not None and msg.seq >= stop:
                break  # the rest will come (or came) live
            out.append(msg)
        else:
            return None
        return sorted(out, key=lambda m: m.seq)
    finally:
        dealer.close(linger=0)


class StopOnExit:
    """Leaving a ``with`` block calls ``self.stop()`` (which the class
    defines), whatever the block raised; the exception is not swallowed."""

    def stop(self) -> None:
        raise NotImplementedError

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
