"""The kvhit connector's wire format and options, shared by both sides.

The scheduler side (``vllm_connector.KvhitLookupClient``) and worker rank 0
(``vllm_lookup_server.KvhitLookupServer``) talk over one ZMQ socket beside
vLLM's own lookup socket (:func:`kvhit_rpc_path`). A request message is a
msgpack list of ``(num_tokens, hash width, hashes joined)`` per request
(:func:`wire_item`); the reply is a msgpack list of vLLM's own encoded
``MooncakeLookupResult`` per request, or an empty list (every request a
miss). The client's DEALER sends ``[b"", seq (8 bytes), payload]`` and the
server's ROUTER replies with the same envelope; a REQ client (``[b"",
payload]``, no seq) is answered ``[b"", reply]``. To a DEALER (the kvhit
client) the batched path replies in the array form instead
(:func:`pack_answer`): a ``K`` byte, ``B`` and ``G`` (two uint32), the hits
(int32 ``[B]``) and the tail boundaries (int32 ``[B, G]``, 0 where vLLM lists
none), built and read without a Python object per request on the server;
:func:`decode_reply` reads either form.

When both sides live in one process (vLLM's single-process executor runs
worker rank 0 beside the scheduler), the server also binds an ``inproc://``
endpoint on the process's shared ZMQ context and the client connects there
(:func:`local_endpoint`): the same socket and messages, without the two ZMQ
I/O threads an ``ipc://`` message wakes on its way each direction.

The ``kv_connector_extra_config`` options both sides read are here too.
"""

from __future__ import annotations

import itertools
import struct
import threading
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
    MooncakeLookupResult,
    TailKeyBoundary,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.protocol import (
    decode_lookup_response,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import (
    get_zmq_rpc_path_lookup,
)

from kvhit.coordinator.packing import HashBatch

__all__ = [
    "DEFAULT_LOOKUP_TIMEOUT_S",
    "DEFAULT_MAX_BATCH",
    "DEFAULT_RETRY_S",
    "DEFAULT_STORE_TIMEOUT_S",
    "EMPTY_REPLY",
    "decode_reply",
    "pack_answer",
    "REPLY_DECODER",
    "REQUEST_DECODER",
    "REQUEST_ENCODER",
    "SEQ",
    "connector_extra",
    "joined_batch",
    "kvhit_rpc_path",
    "local_endpoint",
    "positive_option",
    "publish_local",
    "split_hashes",
    "withdraw_local",
    "wire_item",
]


#: Requests one lookup message resolves at most (``kvhit_max_batch``).
DEFAULT_MAX_BATCH = 4096
#: Seconds a synchronous ``schedule()`` waits at most for a batch's answer
#: (``kvhit_lookup_timeout_s``) before it treats every request of the batch
#: as a miss, whatever the store or the server does.
DEFAULT_LOOKUP_TIMEOUT_S = 1.0
#: Seconds worker rank 0 gives one ``batch_is_exist`` (``kvhit_store_timeout_s``)
#: before it answers the batch with misses; below the lookup timeout, so a
#: slow store yields an answer of misses in time, not a client timeout.
DEFAULT_STORE_TIMEOUT_S = 0.5
#: Seconds after a batch went unanswered (the server itself stalled) during
#: which the client answers misses without asking (``kvhit_lookup_retry_s``);
#: the server's late reply, when it comes, ends that at once.
DEFAULT_RETRY_S = 5.0

#: Encodes a request message's payload.
REQUEST_ENCODER = msgspec.msgpack.Encoder()
#: The sequence number frame of a message and its reply.
SEQ = struct.Struct("<Q")
REQUEST_DECODER = msgspec.msgpack.Decoder(list[tuple[int, int, bytes]])
REPLY_DECODER = msgspec.msgpack.Decoder(list[bytes])
#: A reply that answers every request of its batch with a miss.
EMPTY_REPLY = msgspec.msgpack.encode([])
#: The array form's first byte (a msgpack int, never a list) and its header.
_ARRAYS = b"K"
_ARRAYS_HEAD = struct.Struct("<II")


def pack_answer(hits: np.ndarray, tails: np.ndarray) -> bytes:
    """A batch's answer in the array form: ``hits`` int ``[B]`` (each
    request's ``hit_length``) and ``tails`` int ``[B, G]`` (group ``g``'s
    ``TailKeyBoundary.num_tokens``; 0 where vLLM lists no boundary)."""
    b, g = tails.shape
    return b"".join(
        (
            _ARRAYS,
            _ARRAYS_HEAD.pack(b, g),
            hits.astype("<i4", copy=False).tobytes(),
            tails.astype("<i4", copy=False).tobytes(),
        )
    )


def decode_reply(payload: bytes) -> list[MooncakeLookupResult]:
    """A reply's ``MooncakeLookupResult`` per request, in either form (an
    empty list: every request a miss)."""
    if payload[:1] != _ARRAYS:
        return [decode_lookup_response(r) for r in REPLY_DECODER.decode(payload)]
    b, g = _ARRAYS_HEAD.unpack_from(payload, 1)
    start = 1 + _ARRAYS_HEAD.size
    hits = np.frombuffer(payload, "<i4", b, start).tolist()
    tails = np.frombuffer(payload, "<i4", b * g, start + 4 * b).reshape(b, g).tolist()
    # One object per request, as vLLM's decoder builds (the scheduler keeps
    # and may change them); a miss without the boundary loop.
    return [
        MooncakeLookupResult(hit)
        if hit <= 0
        else MooncakeLookupResult(
            hit, tuple([TailKeyBoundary(j, n) for j, n in enumerate(row) if n])
        )
        for hit, row in zip(hits, tails, strict=True)
    ]


def kvhit_rpc_path(vllm_config: VllmConfig) -> str:
    """The IPC path of the kvhit lookup socket: vLLM's lookup path (which
    honours ``VLLM_RPC_BASE_PATH``, ``lookup_rpc_port`` and the DP rank) with
    a ``_kvhit`` suffix, so both servers run side by side."""
    return get_zmq_rpc_path_lookup(vllm_config) + "_kvhit"


# The lookup servers of this process: their ipc path -> their inproc
# endpoint on ``zmq.Context.instance()``.
_LOCAL: dict[str, str] = {}
_LOCAL_LOCK = threading.Lock()
_LOCAL_IDS = itertools.count()


def publish_local(path: str) -> str:
    """A new ``inproc://`` endpoint for the server of ``path`` in this
    process, recorded for :func:`local_endpoint` (each server its own name:
    a client finds a restarted server's new one)."""
    endpoint = f"inproc://kvhit-lookup-{next(_LOCAL_IDS)}"
    with _LOCAL_LOCK:
        _LOCAL[path] = endpoint
    return endpoint


def withdraw_local(path: str, endpoint: str) -> None:
    """Forget ``endpoint`` (its server closes), unless a newer server of
    ``path`` replaced it."""
    with _LOCAL_LOCK:
        if _LOCAL.get(path) == endpoint:
            del _LOCAL[path]


def local_endpoint(path: str) -> str | None:
    """The inproc endpoint of the server of ``path`` in this process (on
    ``zmq.Context.instance()``), or None when it runs elsewhere."""
    return _LOCAL.get(path)


def connector_extra(vllm_config: VllmConfig) -> dict[str, Any]:
    """``kv_connector_extra_config`` of ``vllm_config``."""
    assert vllm_config.kv_transfer_config is not None
    return vllm_config.kv_transfer_config.kv_connector_extra_config


def positive_option(extra: dict[str, Any], name: str, default: Any, kind: type) -> Any:
    """Option ``name`` of ``extra`` (``default`` when absent) as a positive
    ``kind``; ValueError naming the option otherwise."""
    value = extra.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ValueError(
            f"kv_connector_extra_config[{name!r}] must be a positive "
            f"{kind.__name__}, got {value!r}"
        )
    if kind is int and value != int(value):
        raise ValueError(f"kv_connector_extra_config[{name!r}] must be an int")
    return kind(value)


def wire_item(num_tokens: int, hashes: Sequence[bytes]) -> tuple[int, int, bytes]:
    """One request on the wire: ``(num_tokens, hash width, hashes joined)``."""
    return num_tokens, len(hashes[0]) if hashes else 0, b"".join(hashes)


def split_hashes(blob: bytes, width: int) -> list[bytes]:
    """A joined blob as its ``width``-byte hashes (vLLM's own lookup path
    takes a list)."""
    return [blob[o : o + width] for o in range(0, len(blob), width)] if width else []


def joined_batch(
    items: Sequence[tuple[int, int, bytes]], idx: list[int], width: int
) -> tuple[HashBatch, torch.Tensor]:
    """The requests ``idx`` of checked wire ``items`` (all of ``width``-byte
    hashes) as one :class:`HashBatch` straight from their joined blobs (no
    per-hash bytes objects), and their ``num_tokens`` (int64 ``[B]``).

    Rows are little-endian words, the last one zero-padded when ``width`` is
    not a multiple of 8, as ``HashBatch.from_bytes`` packs them."""
    blobs = [items[i][2] for i in idx]
    lens = np.fromiter((len(b) for b in blobs), np.int64, len(idx)) // width
    offsets = np.zeros(len(idx) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    # A bytearray join: one copy, and a writable buffer for torch.
    raw = np.frombuffer(bytearray().join(blobs), dtype=np.uint8).reshape(-1, width)
    words_w = -(-width // 8)
    if width % 8:
        padded = np.zeros((raw.shape[0], 8 * words_w), dtype=np.uint8)
        padded[:, :width] = raw
        raw = padded
    words = raw.view("<i8").astype(np.int64, copy=False)
    batch = HashBatch.from_trusted(
        torch.from_numpy(np.ascontiguousarray(words)), torch.from_numpy(offsets), width
    )
    ntok = torch.from_numpy(np.fromiter((items[i][0] for i in idx), np.int64, len(idx)))
    return batch, ntok
