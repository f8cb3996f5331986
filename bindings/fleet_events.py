"""Follow the KV-cache event streams of N vLLM engines into one FleetIndex.

Each engine's stream (its ``ZmqEventPublisher`` endpoint, replay endpoint and
topic) is followed by its own :class:`kvhit.bindings.events.EventFollower`,
writing into that engine's column of the fleet (:meth:`FleetIndex.engine_view`),
so every engine keeps the single-stream guarantees: atomic batches, gap
repair through its replay endpoint, publisher-restart detection and rebuild,
and a stale flag when its keys may differ from its engine's state. All
followers share one lock, the fleet's only writers; lookups taken through
:class:`FleetFollower` hold it and zero the column of every stale engine, so
a stale engine never serves a hit while the others keep serving.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvhit.bindings.events import EventFollower, StopOnExit
from kvhit.coordinator.fleet_index import FleetIndex

__all__ = ["EngineStream", "FleetFollower"]


@dataclass(frozen=True)
class EngineStream:
    """One engine's event stream: ``engine_id`` (its column in the fleet), the
    PUB ``endpoint``, the replay ``replay_endpoint`` (None: no gap repair)
    and the ``topic``."""

    engine_id: int
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""


class FleetFollower(StopOnExit):
    """One :class:`EventFollower` per engine stream, into one FleetIndex.

    Args:
        fleet: the engines' keys; each stream writes its engine's column.
        streams: one :class:`EngineStream` (or a tuple ``(engine_id,
            endpoint, replay_endpoint[, topic])``) per engine followed; engine
            ids distinct and in ``[0, fleet.num_engines)``. Engines without a
            stream are left to other writers (holding :attr:`lock`).
        medium, honor_clears, default_group_id: as for ``EventFollower``,
            the same for every stream.
        lock: the lock every follower and reader takes (default: a new
            ``RLock``).
        **follower_kwargs: passed to every ``EventFollower`` (``start_seq``,
            ``replay_timeout_s``, ``idle_probe_s``, ...).

    Every argument is validated before any socket is opened
    (TypeError/ValueError naming it).
    """

    def __init__(
        self,
        fleet: FleetIndex,
        streams: Sequence[EngineStream | tuple],
        medium: str | Collection[str] | None = None,
        *,
        honor_clears: bool = True,
        default_group_id: int = 0,
        lock: threading.RLock | threading.Lock | None = None,
        **follower_kwargs: Any,
    ) -> None:
        if not isinstance(fleet, FleetIndex):
            raise TypeError(f"fleet must be a FleetIndex, got {type(fleet).__name__}")
        if isinstance(streams, str | bytes) or not isinstance(streams, Sequence):
            raise TypeError("streams must be a sequence of EngineStream")
        parsed: list[EngineStream] = []
        for i, s in enumerate(streams):
            if isinstance(s, tuple):
                try:
                    s = EngineStream(*s)
                except TypeError as exc:
                    raise TypeError(f"streams[{i}]: {exc}") from None
            if not isinstance(s, EngineStream):
                raise TypeError(
                    f"streams[{i}] must be an EngineStream, got {type(s).__name__}"
                )
            e = s.engine_id
            if isinstance(e, bool) or not isinstance(e, int):
                raise TypeError(f"streams[{i}].engine_id must be an int")
            if not 0 <= e < fleet.num_engines:
                raise ValueError(
                    f"streams[{i}].engine_id must be in [0, {fleet.num_engines}), "
                    f"got {e}"
                )
            parsed.append(s)
        ids = [s.engine_id for s in parsed]
        if len(set(ids)) != len(ids):
            raise ValueError(f"streams: engine ids must be distinct, got {ids}")
        self.fleet = fleet
        self.lock = lock if lock is not None else threading.RLock()
        self.streams = tuple(parsed)
        # EventFollower validates its own arguments (endpoints, topic, ...);
        # none opens a socket before start().
        self.followers: dict[int, EventFollower] = {
            s.engine_id: EventFollower(
                s.endpoint,
                s.replay_endpoint,
                fleet.engine_view(s.engine_id),
                topic=s.topic,
                medium=medium,
                honor_clears=honor_clears,
                default_group_id=default_group_id,
                lock=self.lock,
                **follower_kwargs,
            )
            for s in parsed
        }

    # -- lifecycle

    def start(self, timeout_s: float = 5.0) -> FleetFollower:
        """Start every follower (each returns once its socket is connected);
        on a failure the ones started are stopped and the error raised."""
        started = []
        try:
            for f in self.followers.values():
                f.start(timeout_s)
                started.append(f)
        except BaseException:
            for f in started:
                f.stop()
            raise
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop every follower (bounded)."""
        for f in self.followers.values():
            f.stop(timeout_s)

    def remove_engine(self, engine_id: int, timeout_s: float = 5.0) -> int:
        """Stop following ``engine_id`` and take it out of the fleet
        (:meth:`FleetIndex.remove_engine`); returns how many keys it held.

        Its follower is stopped first, so batches still in flight (queued
        in its socket, or being replayed) are dropped with it and none can
        land in the column after it is cleared. Removing the engine from
        the fleet directly instead makes its follower's next commit fail
        (counted in ``apply_errors``, the engine stale), which is safe but
        noisy. Raises ValueError for an engine without a stream.
        """
        if engine_id not in self.followers:
            raise ValueError(f"engine_id {engine_id!r} has no stream")
        follower = self.followers.pop(engine_id)
        follower.stop(timeout_s)
        with self.lock:
            return self.fleet.remove_engine(engine_id)

    def __enter__(self) -> FleetFollower:
        return self if self.running else self.start()

    @property
    def running(self) -> bool:
        """True while every follower's thread runs."""
        return bool(self.followers) and all(f.running for f in self.followers.values())

    # -- staleness and reads

    def stale_engines(self) -> list[int]:
        """Engine ids whose follower is stale (their keys may be wrong)."""
        return sorted(e for e, f in self.followers.items() if f.stale)

    def stale_mask(self) -> torch.Tensor:
        """bool ``[E]`` (CPU): True for engines whose column must not serve."""
        mask = torch.zeros(self.fleet.num_engines, dtype=torch.bool)
        stale = self.stale_engines()
        if stale:
            mask[stale] = True
        return mask

    def guard_hits(self, hits: torch.Tensor) -> torch.Tensor:
        """``hits`` (int64 ``[B, E]``) with every stale engine's column zeroed
        in place; call it while holding :attr:`lock`."""
        stale = self.stale_engines()
        if stale:
            hits[:, torch.tensor(stale, device=hits.device)] = 0
        return hits

    def fleet_hits(
        self, engine: Any, batch: Any, max_lengths: Any, apply_eagle: bool = True
    ) -> torch.Tensor:
        """``engine.fleet_hits(batch, max_lengths, fleet)`` under :attr:`lock`,
        stale engines' columns zero: int64 ``[B, E]``."""
        with self.lock:
            hits = engine.fleet_hits(batch, max_lengths, self.fleet, apply_eagle)
            return self.guard_hits(hits)

    def fleet_lookup(self, engine: Any, batch: Any, num_tokens: Any) -> torch.Tensor:
        """``engine.fleet_lookup(batch, num_tokens, fleet)`` under :attr:`lock`,
        stale engines' columns zero: int64 ``[B, E]``, tokens to load."""
        with self.lock:
            return self.guard_hits(engine.fleet_lookup(batch, num_tokens, self.fleet))

    def clear_stale(self, engine_id: int | None = None) -> None:
        """Declare one engine's keys (None: every engine's) trustworthy again."""
        if engine_id is None:
            for f in self.followers.values():
                f.clear_stale()
            return
        if engine_id not in self.followers:
            raise ValueError(f"engine_id {engine_id!r} has no stream")
        self.followers[engine_id].clear_stale()

    def counters(self) -> dict[int, dict[str, Any]]:
        """Each followed engine's follower counters (``EventFollower.counters``)."""
        return {e: f.counters() for e, f in self.followers.items()}

    def wait_for_seq(self, engine_id: int, seq: int, timeout_s: float) -> bool:
        """Block until engine ``engine_id``'s batch ``seq`` is applied; bounded."""
        if engine_id not in self.followers:
            raise ValueError(f"engine_id {engine_id!r} has no stream")
        return self.followers[engine_id].wait_for_seq(seq, timeout_s)
