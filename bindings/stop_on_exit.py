"""A context manager's exit that stops what it started, for the event
followers (``bindings/events.py``; ``bindings/fleet_events.py`` may share it)."""

from __future__ import annotations

from types import TracebackType

__all__ = ["StopOnExit"]


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
