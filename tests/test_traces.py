"""bench/traces.py: the shipped Mooncake trace and its prefix-consistent hashes."""

from __future__ import annotations

import gzip
import json
import re

import numpy as np
import pytest

from kvhit.bench.traces import (
    SHIPPED_TRACE,
    TraceRequest,
    hash_block_ids,
    hash_words,
    load_trace,
)


def test_shipped_trace_loads_whole():
    reqs = load_trace()
    assert len(reqs) == 12031
    assert max(r.input_length for r in reqs) == 126195
    assert (SHIPPED_TRACE.parent / "README.md").is_file()  # the attribution


def test_synthetic_trace_loads_whole_with_its_attribution():
    from kvhit.bench.names import SYNTHETIC_TRACE, TRACES

    reqs = load_trace(SYNTHETIC_TRACE)
    assert len(reqs) == 3993
    assert round(np.mean([r.input_length for r in reqs])) == 15325
    assert TRACES == {"conversation": SHIPPED_TRACE, "synthetic": SYNTHETIC_TRACE}
    readme = (SYNTHETIC_TRACE.parent / "README.md").read_text()
    assert "FAST25-release/traces/synthetic_trace.jsonl" in readme


def test_limit_and_plain_jsonl(tmp_path):
    p = tmp_path / "t.jsonl"
    lines = [
        {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [7, 8]},
        {"timestamp": 3, "input_length": 10, "hash_ids": [7]},
    ]
    p.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    got = load_trace(p)
    assert [r.timestamp_ms for r in got] == [0, 3]
    assert got[1].output_length == 0
    assert len(load_trace(p, limit=1)) == 1
    gz = tmp_path / "t.jsonl.gz"
    with gzip.open(gz, "wt") as f:
        f.write(p.read_text())
    assert [r.input_length for r in load_trace(gz)] == [600, 10]


@pytest.mark.parametrize(
    "line, needle",
    [
        ("{nope", "not JSON"),
        ('{"timestamp": -1, "input_length": 1, "hash_ids": [1]}', "'timestamp'"),
        ('{"timestamp": 0, "input_length": 1.5, "hash_ids": [1]}', "'input_length'"),
        ('{"timestamp": 0, "input_length": 513, "hash_ids": [1]}', "hash_ids"),
        ('{"timestamp": 0, "input_length": 1, "hash_ids": ["a"]}', "hash_ids"),
        ("[1, 2]", "JSON object"),
    ],
)
def test_bad_lines_name_file_and_line(tmp_path, line, needle):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 1, "hash_ids": [1]}\n' + line + "\n")
    with pytest.raises(ValueError, match=needle) as e:
        load_trace(p)
    assert "bad.jsonl:2" in str(e.value)


def test_bad_arguments(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_trace(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="trace_block_size"):
        load_trace(trace_block_size=0)
    with pytest.raises(ValueError, match="limit"):
        load_trace(limit=-1)


def _req(ids, n):
    return TraceRequest(0, n, 0, np.asarray(ids, dtype=np.int64))


@pytest.mark.parametrize("h", [16, 64, 256, 512, 1024, 96])
def test_expansion_is_prefix_consistent(h):
    # Two prompts that share trace blocks 0-1 and differ from block 2 on.
    a, b = _req([5, 6, 7, 9], 2000), _req([5, 6, 8], 1500)
    wa = hash_words(*hash_block_ids(a, h), 4)
    wb = hash_words(*hash_block_ids(b, h), 4)
    assert len(wa) == 2000 // h and len(wb) == 1500 // h  # whole hash blocks only
    shared = (2 * 512) // h  # hash blocks ending inside the shared prefix
    n = min(len(wa), len(wb))
    np.testing.assert_array_equal(wa[:shared], wb[:shared])
    assert all((wa[k] != wb[k]).all() for k in range(shared, n))
    # Deterministic, and distinct positions give distinct keys.
    np.testing.assert_array_equal(wa, hash_words(*hash_block_ids(a, h), 4))
    assert len({tuple(r) for r in wa}) == len(wa)


def test_one_word_keys_match_the_first_word():
    ids, pos = hash_block_ids(_req([1, 2], 1024), 128)
    np.testing.assert_array_equal(
        hash_words(ids, pos, 1)[:, 0], hash_words(ids, pos, 4)[:, 0]
    )


@pytest.mark.parametrize(
    "line, needle",
    [
        ('{"input_length": 1, "hash_ids": [1]}', "'timestamp' is missing"),
        ('{"timestamp": null, "input_length": 1, "hash_ids": [1]}', "'timestamp'"),
        ('{"timestamp": true, "input_length": 1, "hash_ids": [1]}', "got `bool`"),
        ('{"timestamp": 0, "input_length": 1}', "'hash_ids' is missing"),
        ('{"timestamp": 0, "input_length": 1, "hash_ids": [1, "a"]}', "'hash_ids[1]'"),
        (
            '{"timestamp": 0, "input_length": 1, "hash_ids": [99999999999999999999]}',
            "'hash_ids[0]'",
        ),
        (
            '{"timestamp": 0, "input_length": 1, "hash_ids": [1], "output_length": -2}',
            "'output_length'",
        ),  # fmt: skip
    ],
)
def test_the_trace_line_schema_names_the_field(tmp_path, line, needle):
    # Regression: a missing field read "'timestamp' must be an int, got None".
    p = tmp_path / "bad.jsonl"
    p.write_text(line + "\n")
    with pytest.raises(ValueError, match=re.escape(needle)) as e:
        load_trace(p)
    assert "bad.jsonl:1" in str(e.value)


def test_extra_keys_are_ignored(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"timestamp": 1, "input_length": 1, "hash_ids": [5], "x": {}}\n')
    assert load_trace(p)[0].hash_ids.tolist() == [5]


def test_truncated_corrupt_and_empty_files(tmp_path):
    line = b'{"timestamp": 0, "input_length": 1, "hash_ids": [1]}\n'
    data = gzip.compress(line * 500)
    gz = tmp_path / "t.jsonl.gz"
    gz.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated"):
        load_trace(gz)
    gz.write_bytes(data[:10] + b"\xff" * 30 + data[40:])
    with pytest.raises(ValueError, match="corrupt"):
        load_trace(gz)
    empty = tmp_path / "e.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="no request"):
        load_trace(empty)
    assert load_trace(empty, limit=0) == []
