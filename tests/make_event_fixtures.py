"""Generate the KV-event wire fixtures under ``tests/data/`` with vLLM's own code.

Run once (the produced bytes are committed; the tests never need vLLM)::

    pip download vllm==0.33.0 --no-deps -d /tmp/vllm   # the wheel, ~500 MB
    python tests/make_event_fixtures.py --wheel /tmp/vllm/vllm-0.33.0-*.whl

Why this way: the point of the fixtures is that their bytes are *vLLM's*, not
our reading of vLLM. So the script loads ``vllm/distributed/kv_events.py``
straight out of the wheel and runs its real ``ZmqEventPublisher`` (its msgspec
encoder, its PUB socket, its ROUTER replay service) on 127.0.0.1, and takes
``maybe_convert_block_hash`` verbatim out of ``vllm/v1/core/kv_cache_utils.py``
(via ``ast``) for the int-hash form. Importing the ``vllm`` package itself
would pull in torch, CUDA and dozens of dependencies, so the handful of
imports ``kv_events.py`` makes are stubbed: a config record, a logger and four
network helpers that only matter for ``tcp://*:0`` endpoints (not used here).

Files written (all deterministic except ZMQ-level framing, which is fixed):

- ``kv_events_vllm_0_33_0.live.msgpack``: msgpack array of the multipart
  messages a SUB socket received, each an array of frames
  ``[topic, seq(8 bytes big-endian), payload]``.
- ``kv_events_vllm_0_33_0.replay.msgpack``: the frames a DEALER received after
  asking the ROUTER for a replay from sequence 1 (``[b"", topic, seq,
  payload]`` per batch, then the end marker ``[b"", b"", seq=-1, b""]``).
- ``kv_events_vllm_0_33_0.expected.json``: what each batch contains, written
  from the Python objects handed to the publisher (hashes as hex), so the
  decode test compares our structs against vLLM's intent, not against
  themselves.
"""

from __future__ import annotations

import argparse
import ast
import glob
import json
import logging
import socket
import sys
import time
import types
import zipfile
from hashlib import sha256
from pathlib import Path
from typing import Any

KV_EVENTS_PATH = "vllm/distributed/kv_events.py"
KV_CACHE_UTILS_PATH = "vllm/v1/core/kv_cache_utils.py"
TOPIC = "kv-events"
PREFIX = "kv_events_vllm_0_33_0"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stub_module(name: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    sys.modules[name] = mod
    return mod


class _KVEventsConfig:
    """Stand-in for vllm.config.kv_events.KVEventsConfig (a plain record)."""

    def __init__(self, **kwargs: Any) -> None:
        self.__dict__.update(kwargs)


def _extract_function(source: str, name: str, env: dict[str, Any]) -> Any:
    """Compile one top-level function out of a module's source, verbatim."""
    tree = ast.parse(source)
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            code = compile(ast.Module(body=[node], type_ignores=[]), name, "exec")
            exec(code, env)
            return env[name]
    raise LookupError(f"{name} not found")


def load_vllm(wheel: str) -> tuple[types.ModuleType, Any]:
    """Load vLLM's kv_events module and its int-hash conversion from the wheel."""
    with zipfile.ZipFile(wheel) as zf:
        kv_events_src = zf.read(KV_EVENTS_PATH).decode()
        utils_src = zf.read(KV_CACHE_UTILS_PATH).decode()

    # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES defaults to 1 in vLLM 0.33.0 (envs.py),
    # i.e. int hashes are what a stock deployment publishes.
    envs = types.SimpleNamespace(VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=True)
    convert = _extract_function(
        utils_src,
        "maybe_convert_block_hash",
        {"envs": envs, "BlockHash": bytes, "ExternalBlockHash": bytes | int},
    )

    for pkg in ("vllm", "vllm.config", "vllm.utils", "vllm.v1", "vllm.v1.core"):
        _stub_module(pkg, __path__=[])
    _stub_module("vllm.config.kv_events", KVEventsConfig=_KVEventsConfig)
    _stub_module("vllm.logger", init_logger=logging.getLogger)

    def _unused(*_a: Any, **_k: Any) -> Any:
        raise NotImplementedError("only needed for tcp://*:0 endpoints")

    _stub_module(
        "vllm.utils.network_utils",
        get_ip=_unused,
        get_tcp_uri=_unused,
        is_valid_ipv6_address=_unused,
        split_zmq_path=_unused,
    )
    _stub_module("vllm.v1.core.kv_cache_utils", ExternalBlockHash=bytes | int)
    mod = types.ModuleType("vllm.distributed.kv_events")
    mod.__file__ = f"{wheel}/{KV_EVENTS_PATH}"
    sys.modules[mod.__name__] = mod
    exec(compile(kv_events_src, mod.__file__, "exec"), mod.__dict__)
    return mod, convert


def _h(tag: str, width: int = 32) -> bytes:
    """A deterministic sha256-width block hash (vLLM's default is sha256_cbor)."""
    return sha256(tag.encode()).digest()[:width]


def build_batches(ev: types.ModuleType, convert: Any) -> list[Any]:
    """The batches to publish; they exercise every field and both hash forms."""
    h = [_h(f"block{i}") for i in range(8)]
    h8 = [_h(f"short{i}", 8) for i in range(3)]
    stored = ev.BlockStored
    removed = ev.BlockRemoved

    def plain(hashes: list[Any], parent: Any, tokens: list[int], **kw: Any) -> Any:
        # A BlockStored of 16-token blocks with no LoRA adapter.
        return stored(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=tokens,
            block_size=16,
            lora_id=None,
            lora_name=None,
            **kw,
        )

    return [
        # 0: Mooncake store style (worker.py: medium="cpu", one hash per event).
        ev.KVEventBatch(
            ts=1000.0,
            events=[
                plain([h[0]], None, list(range(16)), medium="cpu", group_idx=0),
                plain([h[1]], h[0], list(range(16, 32)), medium="cpu", group_idx=1),
            ],
        ),
        # 1: block-pool style: several hashes, every optional field set.
        ev.KVEventBatch(
            ts=1001.5,
            events=[
                stored(
                    block_hashes=[h[2], h[3], h[4]],
                    parent_block_hash=h[1],
                    token_ids=list(range(48)),
                    block_size=16,
                    lora_id=7,
                    medium=ev.MEDIUM_GPU,
                    lora_name="adapter-7",
                    extra_keys=[("adapter-7",), None, ("adapter-7", "salt")],
                    group_idx=2,
                    kv_cache_spec_kind="sliding_window",
                    kv_cache_spec_sliding_window=128,
                    locality="LOCAL",
                    ownership="tier-b",
                    session_id="sess-1",
                    lookahead_token_ids=[[48], [49], [50]],
                ),
                removed(block_hashes=[h[0]], medium="cpu", group_idx=0),
                plain([h[0]], None, list(range(16)), medium="cpu", group_idx=0),
                removed(block_hashes=[h[3]], medium=ev.MEDIUM_GPU, group_idx=2),
            ],
        ),
        # 2: a prefix-cache reset, then new blocks; no group_idx / medium.
        ev.KVEventBatch(
            ts=1002.25,
            events=[
                ev.AllBlocksCleared(),
                plain([h[5], h[6]], None, list(range(32)), medium=None),
            ],
        ),
        # 3: int hashes as a stock deployment publishes them
        # (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1): 32-byte hashes truncated to
        # their low 64 bits, and 8-byte hashes (exactly invertible).
        ev.KVEventBatch(
            ts=1003.0,
            events=[
                plain(
                    [convert(h[7])],
                    convert(h[6]),
                    list(range(16)),
                    medium="cpu",
                    group_idx=0,
                ),
                plain(
                    [convert(x) for x in h8],
                    None,
                    list(range(48)),
                    medium="cpu",
                    group_idx=3,
                ),
                removed(block_hashes=[convert(h8[1])], medium="cpu", group_idx=3),
            ],
        ),
        # 4: an empty batch (vLLM publishes one per step with no events only
        # if the scheduler chooses to; the decoder must accept it).
        ev.KVEventBatch(ts=1004.0, events=[], data_parallel_rank=1),
    ]


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"hex": value.hex()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def expected_json(batches: list[Any]) -> list[dict[str, Any]]:
    out = []
    for seq, batch in enumerate(batches):
        events = []
        for e in batch.events:
            d: dict[str, Any] = {"type": type(e).__name__}
            for field in e.__struct_fields__:
                d[field] = _jsonable(getattr(e, field))
            events.append(d)
        out.append(
            {
                "seq": seq,
                "ts": batch.ts,
                # The publisher fills in its own rank when the batch has none.
                "data_parallel_rank": batch.data_parallel_rank,
                "events": events,
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--wheel",
        default=next(iter(glob.glob("/tmp/vllm/vllm-0.33.0-*.whl")), None),
        help="path to vllm-0.33.0-*.whl (pip download vllm==0.33.0 --no-deps)",
    )
    parser.add_argument("--out", default=str(Path(__file__).parent / "data"))
    args = parser.parse_args()
    if not args.wheel:
        parser.error("--wheel is required (no /tmp/vllm/vllm-0.33.0-*.whl found)")

    import msgspec
    import zmq

    ev, convert = load_vllm(args.wheel)
    batches = build_batches(ev, convert)

    pub_port, replay_port = _free_port(), _free_port()
    # "*" makes vLLM bind (its _is_bind_endpoint rule); we connect on loopback.
    publisher = ev.ZmqEventPublisher(
        data_parallel_rank=0,
        endpoint=f"tcp://*:{pub_port}",
        replay_endpoint=f"tcp://*:{replay_port}",
        buffer_steps=100,
        topic=TOPIC,
    )
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
    sub.connect(f"tcp://127.0.0.1:{pub_port}")
    time.sleep(0.5)  # PUB/SUB slow joiner: let the subscription propagate
    for batch in batches:
        publisher.publish(batch)

    live: list[list[bytes]] = []
    deadline = time.monotonic() + 10
    while len(live) < len(batches) and time.monotonic() < deadline:
        if sub.poll(200):
            live.append(sub.recv_multipart())
    if len(live) != len(batches):
        raise SystemExit(f"received {len(live)} of {len(batches)} live batches")

    # Replay protocol: a DEALER sends [b"", start_seq(8 bytes big-endian)]; the
    # ROUTER sees [identity, b"", start_seq] as _service_replay expects.
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{replay_port}")
    dealer.send_multipart([b"", (1).to_bytes(8, "big")])
    replay: list[list[bytes]] = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if dealer.poll(200):
            frames = dealer.recv_multipart()
            replay.append(frames)
            if frames[2] == ev.ZmqEventPublisher.END_SEQ:
                break
    else:
        raise SystemExit("replay did not end with the END_SEQ marker")

    publisher.shutdown()
    sub.close(linger=0)
    dealer.close(linger=0)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{PREFIX}.live.msgpack").write_bytes(msgspec.msgpack.encode(live))
    (out / f"{PREFIX}.replay.msgpack").write_bytes(msgspec.msgpack.encode(replay))
    # The publisher stamped data_parallel_rank=0 on batches that had none.
    (out / f"{PREFIX}.expected.json").write_text(
        json.dumps(
            {
                "vllm": "0.33.0",
                "topic": TOPIC,
                "end_seq_hex": ev.ZmqEventPublisher.END_SEQ.hex(),
                "batches": expected_json(batches),
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {len(live)} live and {len(replay)} replay messages to {out}")


if __name__ == "__main__":
    main()
