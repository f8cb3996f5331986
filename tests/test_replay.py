"""``kvhit replay`` and bench/replay.py on slices of the shipped trace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvhit import cli
from kvhit.bench import replay as rp
from kvhit.bench.harness import MismatchError
from kvhit.bench.peers import load_dynamo
from kvhit.bench.traces import TraceRequest, load_trace
from kvhit.bench.workloads import PRESETS

TRACE = load_trace(limit=240)
HAVE_DYNAMO = load_dynamo()[0] is not None


def _req(ts: int) -> TraceRequest:
    import numpy as np

    return TraceRequest(ts, 512, 1, np.array([ts], dtype=np.int64))


def test_steps_of_windows_and_fixed_batches() -> None:
    reqs = [_req(t) for t in (0, 50, 99, 100, 250, 251, 1000)]
    assert rp.steps_of(reqs, 100, 1, None) == [[0, 1, 2], [3], [4, 5], [6]]
    # speedup 10: a 100 ms step covers 1 s of trace time.
    assert rp.steps_of(reqs, 100, 10, None) == [[0, 1, 2, 3, 4, 5], [6]]
    assert rp.steps_of(reqs, 100, 1, 3) == [[0, 1, 2], [3, 4, 5], [6]]
    # Out-of-order timestamps: each falls in its window, in arrival order.
    shuffled = [_req(t) for t in (150, 10, 120)]
    assert rp.steps_of(shuffled, 100, 1, None) == [[1], [2, 0]]


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_replays_checked_by_the_reference(preset: str) -> None:
    # Every step checked by the reference loop (MismatchError otherwise).
    cfg = rp.ReplayConfig(preset=preset, reference_requests=len(TRACE))
    res = rp.replay(cfg, requests=TRACE[:120])
    assert res.requests == 120 and res.reference_requests == 120
    assert res.prompt_tokens == sum(r.input_length for r in TRACE[:120])
    assert 0 < res.hit_tokens <= res.prompt_tokens
    assert res.store_keys > 0
    if preset == "llama":  # full attention only: the claim is the exact hit
        assert res.claimed_tokens == res.hit_tokens
    if preset == "dsv4-flash":  # hybrid + EAGLE: the claim overstates it
        assert res.claimed_tokens > res.hit_tokens


@pytest.mark.parametrize("preset", list(PRESETS))
def test_bounded_store_evicts_and_stays_exact(preset: str) -> None:
    cfg = rp.ReplayConfig(preset=preset, store_blocks=5000, reference_requests=240)
    res = rp.replay(cfg, requests=TRACE[:120])
    assert res.store_keys <= 5000 and res.evicted_keys > 0
    free = rp.replay(rp.ReplayConfig(preset=preset), requests=TRACE[:120])
    assert res.hit_tokens <= free.hit_tokens


def test_a_wrong_answer_is_a_mismatch(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvhit.coordinator.engine import LookupEngine

    real = LookupEngine.lookup

    def off_by_one(self, batch, num_tokens, index):
        return real(self, batch, num_tokens, index) + 16

    monkeypatch.setattr(LookupEngine, "lookup", off_by_one)
    with pytest.raises(MismatchError, match="reference"):
        rp.replay(rp.ReplayConfig(preset="llama"), requests=TRACE[:40])


def test_config_validates() -> None:
    for bad in (
        {"preset": "nope"},
        {"step_ms": 0},
        {"speedup": -1},
        {"batch": 0},
        {"store_blocks": 0},
        {"reference_requests": -1},
        {"peer": "sglang"},
    ):
        with pytest.raises(ValueError):
            rp.ReplayConfig(**bad)


def test_cli_replay_json_and_exit_codes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.json"
    argv = ["replay", "--preset", "qwen3-next", "--limit", "80", "-q"]
    assert cli.main([*argv, "--json", str(out), "--batch", "8"]) == cli.EXIT_OK
    doc = json.loads(out.read_text())
    assert doc["requests"] == 80 and doc["steps"] == 10
    assert doc["hit_rate"] == doc["hit_tokens"] / doc["prompt_tokens"]
    assert "full-attention claim" in capsys.readouterr().out
    # Bad arguments: exit 2 before any work.
    for bad in (
        ["replay", str(tmp_path / "missing.jsonl")],
        ["replay", "--step-ms", "0"],
        ["replay", "--speedup", "nan"],
        ["replay", "--batch", "0"],
        ["replay", "--peer", "sglang"],
        ["replay", "--json", str(tmp_path / "no" / "x.json")],
    ):
        with pytest.raises(SystemExit) as exc:
            cli.main(bad)
        assert exc.value.code == cli.EXIT_USAGE, bad
    bad_trace = tmp_path / "bad.jsonl"
    bad_trace.write_text('{"timestamp": 0, "input_length": 600, "hash_ids": [1]}\n')
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        cli.main(["replay", str(bad_trace), "-q"])
    assert exc.value.code == cli.EXIT_USAGE
    assert "bad.jsonl:1" in capsys.readouterr().err


def test_cli_mismatch_exits_1_and_internal_error_3(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def mismatch(*a, **k):
        raise MismatchError("kvhit=1 reference=0")

    monkeypatch.setattr(rp, "replay", mismatch)
    assert cli.main(["replay", "--limit", "5", "-q"]) == cli.EXIT_MISMATCH

    def broken(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(rp, "replay", broken)
    assert cli.main(["replay", "--limit", "5", "-q"]) == cli.EXIT_INTERNAL
    assert "boom" in capsys.readouterr().err


def test_cli_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "r.png"
    argv = ["replay", "--preset", "gemma3", "--limit", "60", "-q", "--plot", str(png)]
    assert cli.main(argv) == cli.EXIT_OK
    assert png.stat().st_size > 1000


@pytest.mark.skipif(not HAVE_DYNAMO, reason="ai-dynamo-runtime is not importable")
@pytest.mark.parametrize("preset", ["llama", "dsv4-flash"])
def test_dynamo_peer_agrees_on_a_trace_slice(preset: str) -> None:
    res = rp.replay(rp.ReplayConfig(preset=preset, peer="dynamo"), requests=TRACE)
    assert res.peer_skipped is None and res.peer_checked == len(TRACE)
    assert res.peer_blocks_stored > 0
    assert all(s.peer_lookup_s is not None for s in res.steps)
    if preset == "llama":
        assert res.claimed_tokens == res.hit_tokens


@pytest.mark.skipif(not HAVE_DYNAMO, reason="ai-dynamo-runtime is not importable")
def test_dynamo_disagreeing_is_a_mismatch(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvhit.bench.peers import DynamoIndex

    real = DynamoIndex.find
    monkeypatch.setattr(
        DynamoIndex, "find", lambda self, chains: [n + 1 for n in real(self, chains)]
    )
    with pytest.raises(MismatchError, match="dynamo"):
        rp.replay(rp.ReplayConfig(preset="llama", peer="dynamo"), requests=TRACE[:20])


def test_peer_absent_is_skipped_with_the_reason(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(rp, "load_dynamo", lambda: (None, "not installed here"))
    res = rp.replay(rp.ReplayConfig(preset="llama", peer="dynamo"), requests=TRACE[:20])
    assert res.peer_skipped == "not installed here" and res.peer_checked == 0
    assert "skipped: not installed here" in rp.format_report(res)


# -- kvhit bench --peer dynamo (bench/harness.py) -----------------------------


@pytest.mark.skipif(not HAVE_DYNAMO, reason="ai-dynamo-runtime is not importable")
def test_bench_peer_column_on_a_trace_slice(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "b.json"
    argv = ["bench", "--presets", "llama", "--batch-sizes", "1,8", "--max-tokens",
            "256", "--repeats", "1", "-q", "--peer", "dynamo", "--peer-limit",
            "150", "--peer-host-load", "0,1", "--peer-order", "separate,alternate",
            "--json", str(out)]  # fmt: skip
    assert cli.main(argv) == cli.EXIT_OK
    text = capsys.readouterr().out
    assert "kvhit vs dynamo" in text and "busy1" in text and "alternate" in text
    peers = json.loads(out.read_text())["peers"]
    assert [(p["order"], p["host_load"], p["batch_size"]) for p in peers] == [
        ("separate", 0, 1), ("separate", 0, 8), ("separate", 1, 1),
        ("separate", 1, 8), ("alternate", 0, 1), ("alternate", 0, 8),
        ("alternate", 1, 1), ("alternate", 1, 8),
    ]  # fmt: skip
    assert all(p["requests"] == 150 and p["mismatches"] == 0 for p in peers)
    # A step does not see its own stores: bigger steps hit no more.
    assert peers[0]["hit_blocks"] >= peers[1]["hit_blocks"] > 0
    # The same answers whatever spins beside the run, in either order.
    assert len({p["hit_blocks"] for p in peers if p["batch_size"] == 1}) == 1
    assert len({p["hit_blocks"] for p in peers if p["batch_size"] == 8}) == 1


def test_bench_peer_order_is_checked(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "--presets", "llama", "--peer", "dynamo", "--peer-order", "both"]
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--peer-order" in err and "alternate" in err


def test_busy_host_spins_and_stops(tmp_path: Path) -> None:
    import os

    from kvhit.bench.peers import busy_host

    def children() -> set[int]:
        path = f"/proc/{os.getpid()}/task/{os.getpid()}/children"
        return (
            set(map(int, open(path).read().split())) if os.path.exists(path) else set()
        )

    before = children()
    with busy_host(2):
        spinning = children() - before
        assert len(spinning) == 2 or not os.path.exists("/proc")
    assert not (children() & spinning)
    with pytest.raises(ValueError, match="processes"):
        with busy_host(-1):
            pass
    with pytest.raises(TypeError, match="processes"):
        with busy_host(True):
            pass


def test_pinned_puts_every_thread_on_one_cpu_and_restores() -> None:
    import contextlib
    import os
    import threading

    from kvhit.bench.peers import pinned

    if not hasattr(os, "sched_setaffinity") or not os.path.exists("/proc"):
        pytest.skip("needs Linux's sched_setaffinity and /proc")
    cpu = min(os.sched_getaffinity(0))

    def tasks() -> dict[int, set[int]]:
        out = {}
        for t in os.listdir("/proc/self/task"):
            # Another test's thread may end between the listing and the read
            # (a CI run once failed here), as pinned() itself allows for.
            with contextlib.suppress(ProcessLookupError):
                out[int(t)] = os.sched_getaffinity(int(t))
        return out

    def same(a: dict[int, set[int]], b: dict[int, set[int]]) -> bool:
        """Equal on the threads alive in both (others may end meanwhile)."""
        return all(a[t] == b[t] for t in a.keys() & b.keys())

    stop = threading.Event()
    other = threading.Thread(target=stop.wait)  # a thread started before
    other.start()
    try:
        before = tasks()
        with pinned(cpu):
            inside = tasks()
            assert other.native_id in inside  # a thread started before: pinned
            assert all(v == {cpu} for v in inside.values())
        assert same(tasks(), before)
        with pinned(None):
            assert same(tasks(), before)
    finally:
        stop.set()
        other.join()
    with pytest.raises(TypeError, match="cpu"):
        with pinned(True):  # type: ignore[arg-type]
            pass
    with pytest.raises(ValueError, match="cpu"):
        with pinned(10_000):
            pass
    assert same(tasks(), before)


@pytest.mark.parametrize(
    "argv",
    [
        ["--pin", "x"],
        ["--pin", "10000"],
        ["--host-load", "-1"],
        ["--host-load", "a"],
        ["--call", "bytes"],
        ["--call", ""],
    ],
)
def test_peer_targets_cli_names_a_bad_flag(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    from kvhit.bench import peer_targets as pt

    with pytest.raises(SystemExit) as exc:
        pt.main(argv)
    assert exc.value.code == 2 and argv[0] in capsys.readouterr().err


def test_bench_peer_host_load_is_checked(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "--presets", "llama", "--peer", "dynamo", "--peer-host-load", "-1"]
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2 and "--peer-host-load" in capsys.readouterr().err


@pytest.mark.skipif(not HAVE_DYNAMO, reason="ai-dynamo-runtime is not importable")
def test_bench_peer_mismatch_exits_1(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvhit.bench.peers import DynamoIndex

    real = DynamoIndex.find
    monkeypatch.setattr(
        DynamoIndex, "find", lambda self, chains: [n + 1 for n in real(self, chains)]
    )
    argv = ["bench", "--presets", "llama", "--batch-sizes", "4", "--max-tokens",
            "256", "--repeats", "1", "-q", "--peer", "dynamo", "--peer-limit", "20"]  # fmt: skip
    assert cli.main(argv) == cli.EXIT_MISMATCH


def test_bench_peer_absent_is_skipped(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvhit.bench import peer_steps

    # kvhit bench replays through peer_steps: its skip is reported, exit 0.
    monkeypatch.setattr(peer_steps, "load_dynamo", lambda: (None, "not here either"))
    argv = ["bench", "--presets", "llama", "--batch-sizes", "4", "--max-tokens",
            "256", "--repeats", "1", "-q", "--peer", "dynamo", "--peer-limit", "5"]  # fmt: skip
    assert cli.main(argv) == cli.EXIT_OK
    assert "skipped dynamo: not here either" in capsys.readouterr().out


# -- bench/peer_steps.py: the peer replay as a router meets it (issue 33) -----


def test_step_inputs_are_raw_trace_ids_in_python_lists() -> None:
    from kvhit.bench import peer_steps as ps

    inputs = ps.step_inputs(TRACE[:50])
    assert all(type(r) is list for r in inputs.ints) and type(inputs.tokens) is list
    assert all(type(v) is int for r in inputs.ints for v in r)
    assert inputs.ints[0][:2] == [0, 1] and inputs.chains is inputs.ints
    assert [len(r) for r in inputs.ints] == [t // 512 for t in inputs.tokens]
    hashed = ps.step_inputs(TRACE[:50], "hashed")
    assert [len(r) for r in hashed.ints] == [len(r) for r in inputs.ints]
    assert not {0, 1} & {v for r in hashed.ints for v in r}
    with pytest.raises(ValueError, match="ids"):
        ps.step_inputs(TRACE[:5], "cooked")


def test_peer_steps_arguments_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvhit.bench import peer_steps as ps

    with pytest.raises(ValueError, match="order"):
        ps.peer_sweep("dynamo", [1], limit=5, order="sideways")
    with pytest.raises(ValueError, match="order"):
        ps.peer_sweep("dynamo", [1], limit=5, order=())
    with pytest.raises(ValueError, match="ids"):
        ps.peer_sweep("dynamo", [1], limit=5, ids="cooked")
    with pytest.raises(ValueError, match="lengths"):
        ps.peer_sweep("dynamo", [1], limit=5, lengths="tuple")
    with pytest.raises(ValueError, match="call"):
        ps.peer_sweep("dynamo", [1], limit=5, call="bytes")
    for passes in (0, True, 1.5):
        with pytest.raises(ValueError, match="passes"):
            ps.peer_sweep("dynamo", [1], limit=5, passes=passes)
    with pytest.raises(ValueError, match="peer"):
        ps.peer_sweep("lmcache", [1], limit=5)
    monkeypatch.setattr(ps, "load_dynamo", lambda: (None, "not installed here"))
    rows, skip = ps.peer_sweep("dynamo", [1], limit=5)
    assert rows == [] and skip == ps.PeerSkip("dynamo", "not installed here")


@pytest.mark.skipif(not HAVE_DYNAMO, reason="ai-dynamo-runtime is not importable")
def test_peer_steps_replay_raw_ids_in_both_orders() -> None:
    from kvhit.bench import peer_steps as ps

    rows, skip = ps.peer_sweep("dynamo", [1, 16], limit=300, passes=2)
    assert skip is None
    assert [(r.order, r.batch_size) for r in rows] == [
        ("separate", 1), ("separate", 16), ("alternate", 1), ("alternate", 16)
    ]  # fmt: skip
    # The orders change the timing only: the same answers and stores.
    by_b = {b: {(r.hit_blocks, r.blocks_stored) for r in rows if r.batch_size == b}
            for b in (1, 16)}  # fmt: skip
    assert all(len(v) == 1 for v in by_b.values())
    assert rows[0].hit_blocks >= rows[1].hit_blocks > 0
    # find_hit_list packs inside its call: no packing figure of its own.
    assert all(r.kvhit_pack_s != r.kvhit_pack_s for r in rows)
    assert all(r.kvhit_lookup_s > 0 and r.kvhit_store_bps > 0 for r in rows)
    table = ps.format_orders(rows)
    assert "alternate / separate" in table and table.count("\n") == 4
    assert "| - / - |" in table
    # Lengths as a numpy array (a router's slice of one), and the lookup as
    # from_ints + find_longest_cache_hit + hit_list: the same answers.
    rows_np, _ = ps.peer_sweep("dynamo", [16], limit=300, lengths="numpy")
    assert {(r.hit_blocks, r.blocks_stored) for r in rows_np} == by_b[16]
    rows_b, _ = ps.peer_sweep("dynamo", [1, 16], limit=300, call="batch")
    for b in (1, 16):
        got = {(r.hit_blocks, r.blocks_stored) for r in rows_b if r.batch_size == b}
        assert got == by_b[b]
    assert all(r.kvhit_pack_s > 0 for r in rows_b)


@pytest.mark.skipif(not HAVE_DYNAMO, reason="ai-dynamo-runtime is not importable")
def test_peer_steps_mismatch_is_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvhit.bench import peer_steps as ps
    from kvhit.bench.peers import DynamoIndex

    real = DynamoIndex.find
    monkeypatch.setattr(
        DynamoIndex, "find", lambda self, chains: [n + 1 for n in real(self, chains)]
    )
    with pytest.raises(ps.PeerMismatchError, match="dynamo disagrees"):
        ps.peer_sweep("dynamo", [4], limit=20, order="alternate")
    # kvhit bench passes its own error class (exit 1 on a mismatch).
    with pytest.raises(MismatchError, match="dynamo disagrees"):
        ps.peer_sweep("dynamo", [4], limit=20, mismatch=MismatchError)


def test_peer_rows_past() -> None:
    import numpy as np

    from kvhit.bench import peer_steps as ps

    got = ps.rows_past(
        np.array([0, 3, 3, 10]), np.array([3, 0, 7, 2]), np.array([1, 0, 5, 2])
    )
    assert got.tolist() == [1, 2, 8, 9]


def test_from_ints_rates_time_every_form() -> None:
    from kvhit.bench import peer_steps as ps
    from kvhit.bench import peer_targets as pt

    ints = ps.step_inputs(TRACE[:40]).ints
    slow = lambda reqs: None  # noqa: E731
    rates = pt.from_ints_rates(ints, batch=8, repeats=1, steps=2,
                               impls={"a": slow, "b": slow})  # fmt: skip
    assert list(rates) == list(pt.FORMS) and all(
        set(r) == {"a", "b"} and min(r.values()) >= 0 for r in rates.values()
    )


@pytest.mark.skipif(not HAVE_DYNAMO, reason="ai-dynamo-runtime is not importable")
def test_peer_targets_sections_per_host_and_lengths_form() -> None:
    from kvhit.bench import peer_targets as pt

    text = pt.targets(
        limit=40, batch_sizes=(1, 4), fleet_engines=(), passes=1,
        host_loads=(0,), lengths=("list", "numpy"), pins=(None, 0),
    )  # fmt: skip
    assert "lengths as a list (Python list)" in text
    assert "lengths as a numpy (numpy int64 array)" in text
    assert text.count("| lookup incl. packing vs Dynamo") == 4
    assert text.count("every thread on CPU 0") == 2


def test_peer_targets_without_dynamo_names_why(monkeypatch) -> None:
    # A host without ai-dynamo-runtime: the lookup and fleet sections say it
    # was skipped and why; nothing raises (the fleet used to call None).
    from kvhit.bench import bench_fleet, peer_steps
    from kvhit.bench import peer_targets as pt

    gone = lambda: (None, "ai-dynamo-runtime is not importable (test)")  # noqa: E731
    for mod in (peer_steps, pt, bench_fleet):
        monkeypatch.setattr(mod, "load_dynamo", gone)
    text = pt.targets(limit=40, batch_sizes=(1,), fleet_engines=(8,), passes=1)
    assert "Dynamo skipped: ai-dynamo-runtime is not importable (test)" in text
    assert "Fleet vs Dynamo skipped: ai-dynamo-runtime is not importable (test)" in text
    with pytest.raises(RuntimeError, match="not importable"):
        bench_fleet.dynamo_tree(None, lambda i: 0)
