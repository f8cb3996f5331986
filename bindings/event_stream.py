"""The pieces of a KV-event stream that a follower handles, apart from its
logic (``bindings/events.py``): a batch as received, the commit being built
from batches in order, the signal that the stream belongs to a new
publisher, the client side of vLLM's replay protocol, and the
``with``-block behaviour every follower shares."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from kvhit.bindings.kv_events import END_SEQ, EventPlan

__all__ = [
    "PendingCommit",
    "PublisherRestart",
    "StopOnExit",
    "StreamMsg",
    "request_replay",
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


class PublisherRestart(Exception):
    """Raised inside a follower when the stream belongs to a new publisher."""


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
