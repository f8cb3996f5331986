"""The event-storm tests' publisher, replay server and small helpers.

:class:`StormPublisher` speaks vLLM 0.33.0's KV-event ZMQ format (an XPUB
stream of ``(topic, seq, payload)``, a ROUTER replay answering ``[b"",
start_seq]`` with every buffered batch then the end marker) with faults the
tests inject: drops, reorders, duplicates, restarts, batches lost from a
replay's answer, a silent replay endpoint. :func:`one_follower` starts an
EventFollower on one; :func:`replay_set` and :func:`key_set` are the truth
and the index as sets of ``(group, key bytes)``. Shared by
``test_event_storm.py`` and ``test_event_repair.py``.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Iterator
from typing import Any

import pytest

zmq = pytest.importorskip("zmq", exc_type=ImportError)

from helpers import bind_retrying  # noqa: E402

from kvhit.bindings import kv_events as kv  # noqa: E402
from kvhit.coordinator.packing import unpack_hashes  # noqa: E402

TOPIC = "kv"
WAIT_S = 20.0
HASH_BYTES = 8  # vLLM's default int hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1)


class StormPublisher:
    """One vLLM ``ZmqEventPublisher`` as the wire sees it, driven by the test.

    XPUB (to wait for the subscription) with a small send queue, so a slow
    subscriber makes ZMQ drop messages as vLLM's PUB would; a ROUTER that
    answers replays like ``ZmqEventPublisher._service_replay`` (served by
    :class:`ReplayServer`). ``reset`` is a new publisher process: seq 0 and
    an empty replay buffer.
    """

    def __init__(
        self, ctx: Any, sndhwm: int = 1000, buffer_steps: int = 10_000
    ) -> None:
        self.ctx = ctx
        self.topic = TOPIC.encode()
        self.sndhwm = sndhwm
        self.pub = self._pub_socket()
        port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.router = self._router_socket()
        port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.replay_endpoint = f"tcp://127.0.0.1:{port}"
        #: Set by :meth:`restart_sockets`; the ReplayServer rebinds the ROUTER.
        self.router_restart = threading.Event()
        self.lock = threading.Lock()
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.seq = 0
        self.replay_requests = 0
        self.held: list[list[bytes]] = []  # frames sent late (reorders)
        #: This incarnation's batches applied to a set (the buffer may wrap).
        self.truth: set[tuple[int, bytes]] = set()
        #: seq -> how many more replays leave it out: the loss of a ROUTER
        #: past its send high-water mark (it drops, silently, as vLLM's does).
        self.lose_in_replay: dict[int, int] = {}
        #: Replay requests are read and counted, never answered (a sick
        #: publisher's replay thread).
        self.mute_replays = False

    def _pub_socket(self) -> Any:
        sock = self.ctx.socket(zmq.XPUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self.sndhwm)
        return sock

    def _router_socket(self) -> Any:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        return sock

    def restart_sockets(self) -> None:
        """A new publisher process on the same ports: the subscriber's
        connection drops and ZMQ reconnects it; seq 0, empty buffer. What is
        published before it reconnects is lost live (replayable)."""
        self.pub.close(linger=0)
        self.pub = self._pub_socket()
        bind_retrying(self.pub, self.endpoint, WAIT_S)
        self.reset()
        self.router_restart.set()

    def rebind_router(self) -> Any:
        """Called by the ReplayServer's thread: a new ROUTER on the port."""
        self.router.close(linger=0)
        self.router = self._router_socket()
        bind_retrying(self.router, self.replay_endpoint, WAIT_S)
        self.router_restart.clear()
        return self.router

    def wait_subscriber(self) -> None:
        assert self.pub.poll(int(WAIT_S * 1000)), "no subscriber"
        assert self.pub.recv() == b"\x01" + self.topic

    def publish(self, payload: bytes, fault: str = "") -> None:
        seq, self.seq = self.seq, self.seq + 1
        apply_to_set(self.truth, payload)
        with self.lock:
            self.buffer.append((seq, payload))
        frames = [self.topic, seq.to_bytes(8, "big"), payload]
        if fault == "drop":
            return
        if fault == "reorder":
            self.held.append(frames)  # goes out after the next batch
            return
        self._send(frames)
        if fault == "duplicate":
            self._send(frames)
        for late in self.held:
            self._send(late)
            if fault == "duplicate":
                self._send(late)
        self.held.clear()

    def _send(self, frames: list[bytes]) -> None:
        try:
            self.pub.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            pass  # the subscriber's queue is full: dropped, as PUB does

    def reset(self) -> None:
        with self.lock:
            self.buffer.clear()
        self.truth = set()
        self.seq = 0
        self.held.clear()

    def serve(self) -> None:
        """Answer every replay request queued on the ROUTER."""
        while self.router.poll(0):
            frame = self.router.recv_multipart()
            self.replay_requests += 1
            if len(frame) != 3:
                continue
            client, _, start_b = frame
            if self.mute_replays:
                continue
            start = int.from_bytes(start_b, "big")
            with self.lock:
                buffered = [(s, p) for s, p in self.buffer if s >= start]
            for seq, payload in buffered:
                if self.lose_in_replay.get(seq, 0) > 0:
                    self.lose_in_replay[seq] -= 1
                    continue
                self.router.send_multipart(
                    [client, b"", self.topic, seq.to_bytes(8, "big"), payload]
                )
            self.router.send_multipart([client, b"", b"", kv.END_SEQ, b""])

    def close(self) -> None:
        self.pub.close(linger=0)
        self.router.close(linger=0)


class ReplayServer:
    """One thread serving every publisher's ROUTER (64 threads would be
    64 more schedulers' worth of noise on a 2-core host)."""

    def __init__(self, pubs: list[StormPublisher]) -> None:
        self.pubs = pubs
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        by_socket = {}
        for p in self.pubs:
            poller.register(p.router, zmq.POLLIN)
            by_socket[p.router] = p
        while not self.stop.is_set():
            for sock, _ in poller.poll(20):
                by_socket[sock].serve()
            for p in self.pubs:
                if p.router_restart.is_set():
                    poller.unregister(p.router)
                    del by_socket[p.router]
                    sock = p.rebind_router()
                    poller.register(sock, zmq.POLLIN)
                    by_socket[sock] = p

    def close(self) -> None:
        self.stop.set()
        self.thread.join(WAIT_S)


def key_hash(engine: int, i: int) -> int:
    # >= 2**32 so msgpack writes uint 64: the follower's fast path. A few
    # small ones (i % 7 == 0) take msgpack's short forms: its other path.
    if i % 7 == 0:
        return engine * 1000 + i
    return (0x9E3779B97F4A7C15 * (engine * 1000 + i + 1)) & ((1 << 64) - 1) | (1 << 40)


def apply_to_set(state: set[tuple[int, bytes]], payload: bytes) -> None:
    """One batch applied to a Python set of keys, by the definition."""
    for e in kv.decode_batch(payload).events:
        if isinstance(e, kv.AllBlocksCleared):
            state.clear()
            continue
        keys = {(e.group_idx, kv.hash_to_bytes(h, HASH_BYTES)) for h in e.block_hashes}
        if isinstance(e, kv.BlockStored):
            state |= keys
        else:
            state -= keys


def replay_set(payloads: list[bytes]) -> set[tuple[int, bytes]]:
    """The truth: the batches applied in order to a Python set."""
    state: set[tuple[int, bytes]] = set()
    for payload in payloads:
        apply_to_set(state, payload)
    return state


def key_set(index: Any) -> set[tuple[int, bytes]]:
    g, h = index.keys()
    return set(zip(g.tolist(), unpack_hashes(h, HASH_BYTES), strict=True))


def stores(engine: int, i: int, ts: float) -> bytes:
    """A batch storing three keys of ``engine`` (block ``i``'s)."""
    hashes = [key_hash(engine, 3 * i + j) for j in range(3)]
    event = kv.BlockStored(hashes, None, [], 16, None, "GPU", None, group_idx=0)
    return kv.encode_batch(kv.KVEventBatch(ts, [event]))


@contextlib.contextmanager
def one_follower(**kwargs: Any) -> Iterator[tuple[StormPublisher, Any, Any]]:
    """A started EventFollower (``kwargs`` to it) on a fresh StormPublisher and
    its replay server, into an empty KeyIndex: ``(publisher, index,
    follower)``, all closed on exit."""
    from kvhit import KeyIndex
    from kvhit.bindings import events as events_mod

    ctx = zmq.Context()
    pub = StormPublisher(ctx)
    server = ReplayServer([pub])
    index = KeyIndex(HASH_BYTES, capacity=64)
    f = events_mod.EventFollower(
        pub.endpoint, pub.replay_endpoint, index, topic=TOPIC, **kwargs
    )
    try:
        f.start()
        pub.wait_subscriber()
        assert f.wait_for_seq(-1, WAIT_S)
        yield pub, index, f
    finally:
        f.stop()
        server.close()
        pub.close()
        ctx.term()


def held_commit() -> tuple[list[bool], threading.Event, threading.Event, Any]:
    """A commit hook that holds the follower thread once: set ``hold[0]``,
    and the next commit sets ``entered`` and waits for ``release``."""
    entered, release = threading.Event(), threading.Event()
    hold = [False]

    def on_commit(stats: Any) -> None:
        if hold[0]:
            hold[0] = False
            entered.set()
            release.wait(WAIT_S)

    return hold, entered, release, on_commit
