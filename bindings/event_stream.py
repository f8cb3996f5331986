"""The pieces of a KV-event stream that a follower handles, apart from its
logic (``bindings/events.py``): a batch as received, the commit being built
from batches in order, the signal that the stream belongs to a new
publisher, and the ``with``-block behaviour every follower shares."""

from __future__ import annotations

from dataclasses import dataclass
from types import TracebackType

from kvhit.bindings.kv_events import EventPlan

__all__ = ["PendingCommit", "PublisherRestart", "StopOnExit", "StreamMsg"]


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
