"""``kvhit demo`` / ``kvhit bench`` and the benchmark harness under them, on
tiny configurations."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import run_python

from kvhit import __version__, cli, commands
from kvhit.bench import harness
from kvhit.bench.workloads import TrafficConfig, generate, make_layout
from kvhit.coordinator.engine import LookupEngine

# The smallest workload both commands take (argv fragment).
TINY_WORKLOAD = ["--min-tokens", "32", "--max-tokens", "512", "--repeats", "1"]
TINY_DEMO = [
    "demo",
    "--preset",
    "llama",
    "--requests",
    "24",
    *TINY_WORKLOAD,
    "--no-fresh-process",
    "-q",
]
TINY_BENCH = [
    "bench",
    "--presets",
    "llama,qwen3-next",
    "--batch-sizes",
    "1,8",
    *TINY_WORKLOAD,
    "-q",
]


def _usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Runs ``argv``, asserts exit code 2 (bad arguments), returns stderr."""
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == cli.EXIT_USAGE
    return capsys.readouterr().err


def _must_not_run(*args, **kwargs):
    raise AssertionError("the sweep ran although the arguments were bad")


# -- help, version, exit codes ------------------------------------------------


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0
    assert __version__ in capsys.readouterr().out


def test_help_via_python_m_documents_the_exit_codes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The entry point once in a process of its own; the subcommands' help in
    # this one.
    res = subprocess.run(
        [sys.executable, "-m", "kvhit", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0
    outs = [res.stdout]
    for argv in (["demo", "--help"], ["bench", "--help"]):
        with pytest.raises(SystemExit) as done:
            cli.main(argv)
        assert done.value.code == 0
        outs.append(capsys.readouterr().out)
    for argv, out in zip((["--help"], ["demo"], ["bench"]), outs, strict=True):
        for line in ("0  success", "1  a backend disagreed", "2  bad arguments"):
            assert line in out, (argv, line)
        assert "3  an internal error (its traceback is printed)" in out
    assert "--preset" in outs[-1] or "--presets" in outs[-1]


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 0
    assert "demo" in capsys.readouterr().out


# -- kvhit demo -----------------------------------------------------------------


def test_demo_prints_the_table_and_the_backend_auto_chose(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(TINY_DEMO) == 0
    out = capsys.readouterr().out
    for row in (
        "preset",
        "device",
        "requests",
        "hit / num_tokens",
        "served from store",
        "first call",
        "steady state",
        "lookups/s",
        "reference loop",
        "speedup",
        "24/24 checked requests match",
    ):
        assert row in out, row
    assert "first call, new process" not in out  # --no-fresh-process
    auto = LookupEngine(make_layout("llama")).backend
    assert f"backend            {auto} (auto)" in out


def test_demo_check_all_dsv4_with_a_fresh_process_first_call(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = [a for a in TINY_DEMO if a != "--no-fresh-process"]
    argv += ["--check-all", "--preset", "dsv4-flash", "--max-tokens", "2048"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "24/24 checked requests match" in out
    line = next(ln for ln in out.splitlines() if "first call, new process" in ln)
    assert any(unit in line for unit in (" us", " ms", " s "))


def _corrupt_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every engine runner answers one token too many for every request, so a
    mismatch shows whatever sample the CLI checks."""
    real = harness.engine_runner

    def corrupted(*args, **kwargs) -> harness.Runner:
        runner = real(*args, **kwargs)
        good = runner.run
        return harness.Runner(
            runner.backend, runner.device, lambda: [int(h) + 1 for h in good()]
        )

    monkeypatch.setattr(harness, "engine_runner", corrupted)


def test_demo_mismatch_exits_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _corrupt_engines(monkeypatch)
    assert cli.main(TINY_DEMO) == cli.EXIT_MISMATCH
    err = capsys.readouterr().err
    assert "MISMATCH" in err and "reference=" in err


@pytest.mark.parametrize("error", [RuntimeError, ValueError])
def test_an_error_inside_the_engine_exits_3_with_its_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], error
) -> None:
    # Regression: engine errors were reported as exit 2 ("usage error"), no trace.
    def broken(self, *args, **kwargs):
        raise error("deliberately broken lookup")

    monkeypatch.setattr(LookupEngine, "lookup", broken)
    assert cli.main(TINY_DEMO) == cli.EXIT_INTERNAL
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err
    assert f"{error.__name__}: deliberately broken lookup" in err


def test_demo_requests_zero_exits_2_naming_the_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Regression: --requests 0 exited 0 with an empty report.
    err = _usage_error(["demo", "--requests", "0"], capsys)
    assert "--requests" in err and ">= 1" in err


def test_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--preset" in _usage_error(["demo", "--preset", "nope"], capsys)
    err = _usage_error(["demo", "--min-tokens", "600", "--max-tokens", "500"], capsys)
    assert "--min-tokens" in err and "--max-tokens" in err
    assert "--repeats" in _usage_error(["demo", "--repeats", "0"], capsys)
    assert "--history" in _usage_error(["demo", "--history", "-1"], capsys)
    assert "--backends" in _usage_error(["bench", "--backends", "cuda-magic"], capsys)
    assert "--presets" in _usage_error(["bench", "--presets", "nope"], capsys)


# -- kvhit bench ------------------------------------------------------------------


def test_bench_writes_one_json_of_result_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json = tmp_path / "bench.json"
    argv = [*TINY_BENCH, "--reference-cap", "1", "--sample", "3", "--key-index"]
    argv += ["--json", str(out_json)]
    assert cli.main(argv) == 0
    data = json.loads(out_json.read_text())
    assert data["environment"]["torch"] and data["environment"]["numba"]
    # The memory system's state at both ends (bench/machine.py).
    for end in ("start", "end"):
        assert data["environment"][f"dependent_load_{end}"].startswith("1 MB ")
    rows = [
        harness.ResultRow(**{**r, "times_s": tuple(r["times_s"])})
        for r in data["results"]
    ]
    assert {r.preset for r in rows} == {"llama", "qwen3-next"}
    assert {r.batch_size for r in rows} == {1, 8}
    ref = {
        r.batch_size: r
        for r in rows
        if r.backend == "reference" and r.preset == "llama"
    }
    # Above the cap the reference loop is extrapolated from the sample, and says so.
    assert not ref[1].estimated and ref[1].times_s
    assert ref[8].estimated and not ref[8].times_s and ref[8].reference_estimated
    engines = [r for r in rows if r.backend != "reference"]
    assert engines, "no engine backend ran"
    for r in engines:
        assert r.pack_s_per_request and r.pack_s_per_request > 0
        assert r.speedup_vs_reference and r.speedup_vs_vllm is None
        assert len(r.times_s) == 1 and r.median_s == r.times_s[0]
    assert all(r.parity_checked > 0 for r in rows)
    assert {p["preset"] for p in data["key_index"]} == {"llama", "qwen3-next"}
    # On the CPU, auto leaves triton out, with the reason.
    if harness.default_device() == "cpu":
        assert any(s["backend"] == "triton" for s in data["skipped"])
    table = capsys.readouterr().out
    assert "lookups/s" in table and "x ref" in table and "pack/req" in table
    assert "dependent loads (bench/machine.py): 1 MB " in table


def test_bench_skips_a_backend_whose_engine_cannot_be_built(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = harness.build_engine

    def build(workload, backend, device):
        if backend == "torch":
            raise ValueError("no torch backend on this build")
        return real(workload, backend, device)

    monkeypatch.setattr(harness, "build_engine", build)
    argv = [*TINY_BENCH, "--presets", "llama", "--backends", "reference,torch"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "skipped torch: ValueError: no torch backend on this build" in out
    assert " torch " not in out.split("pack/req")[1].split("skipped")[0]


def test_bench_mismatch_exits_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _corrupt_engines(monkeypatch)
    assert cli.main(TINY_BENCH) == cli.EXIT_MISMATCH
    assert "MISMATCH" in capsys.readouterr().err


@pytest.mark.parametrize("sizes", ["0", "1,0,8", "-4", "x"])
def test_bench_batch_sizes_below_one_exit_2_naming_the_flag(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], sizes: str
) -> None:
    # Regression: --batch-sizes 0 ended in a ZeroDivisionError traceback.
    monkeypatch.setattr(harness, "sweep", _must_not_run)
    err = _usage_error(["bench", "--batch-sizes", sizes], capsys)
    assert "--batch-sizes" in err


def test_bench_unwritable_outputs_fail_before_the_sweep(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Regression: --json /nonexistent/x.json ran the whole sweep, then failed.
    monkeypatch.setattr(harness, "sweep", _must_not_run)
    err = _usage_error(["bench", "--json", "/nonexistent/x.json"], capsys)
    assert "--json" in err and "/nonexistent" in err
    err = _usage_error(["bench", "--json", str(tmp_path)], capsys)
    assert "--json" in err and "directory" in err
    err = _usage_error(["bench", "--plot", str(tmp_path / "no" / "p.png")], capsys)
    assert "--plot" in err


def test_bench_plot_without_matplotlib_exits_2_before_the_sweep(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(harness, "sweep", _must_not_run)
    # A None entry makes `import matplotlib` raise ImportError.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    err = _usage_error([*TINY_BENCH, "--plot", str(tmp_path / "p.png")], capsys)
    assert "needs matplotlib" in err and "pip install" in err
    assert not (tmp_path / "p.png").exists()


def test_bench_plot_with_matplotlib(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "p.png"
    argv = [*TINY_BENCH, "--presets", "llama", "--plot", str(png)]
    assert cli.main(argv) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_vllm_column(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    oracle, why = harness.load_vllm_oracle()
    if oracle is None:
        pytest.skip(f"vLLM oracle not available: {why}")
    out_json = tmp_path / "v.json"
    argv = [*TINY_BENCH, "--presets", "qwen3-next", "--vllm", "--json", str(out_json)]
    assert cli.main(argv) == 0
    rows = json.loads(out_json.read_text())["results"]
    vllm = [r for r in rows if r["backend"] == "vllm"]
    assert {r["batch_size"] for r in vllm} == {1, 8}
    assert all(r["speedup_vs_vllm"] for r in rows)
    assert "x vLLM" in capsys.readouterr().out


# -- the harness ------------------------------------------------------------------


def test_check_parity_names_the_requests() -> None:
    harness.check_parity("x", [0, 16, 32], {0: 0, 2: 32}, [16, 16, 48])
    with pytest.raises(
        harness.MismatchError, match=r"1 of 2 .*#2 \(num_tokens=48\): x=32 reference=16"
    ):
        harness.check_parity("x", [0, 16, 32], {0: 0, 2: 16}, [16, 16, 48])


def test_parity_indices_and_time_calls() -> None:
    assert harness.parity_indices(5, 5, 2, seed=0) == [0, 1, 2, 3, 4]
    sample = harness.parity_indices(100, 10, 7, seed=3)
    assert len(sample) == 7 == len(set(sample)) and sample == sorted(sample)
    assert sample == harness.parity_indices(100, 10, 7, seed=3)
    calls = []
    times = harness.time_calls(lambda: calls.append(1), repeats=4, warmup=2)
    assert times.shape == (4,) and len(calls) == 6 and (times >= 0).all()
    with pytest.raises(ValueError, match="repeats"):
        harness.time_calls(lambda: None, repeats=0)


def test_every_backend_agrees_with_the_reference_loop_exactly() -> None:
    wl = generate("gemma3", TrafficConfig(num_requests=16, max_tokens=1024))
    want = harness.reference_runner(wl).hits()
    assert any(want), "an all-miss workload would prove nothing"
    ran = []
    for name in harness.default_backends("cpu")[0]:
        try:
            runner = harness.make_runner(wl, name, "cpu")
        except ValueError:  # a backend this build's engine does not have
            continue
        assert runner.hits() == want, name
        ran.append(name)
    assert "reference" in ran and len(ran) >= 2


def test_sweep_config_validates() -> None:
    with pytest.raises(ValueError, match="batch_sizes"):
        harness.SweepConfig(presets=("llama",), batch_sizes=(0,))
    with pytest.raises(ValueError, match="unknown backend"):
        harness.SweepConfig(presets=("llama",), backends=("magic",))
    with pytest.raises(ValueError, match="unknown preset"):
        harness.SweepConfig(presets=("nope",))
    row = harness.ResultRow(
        "llama", 1, "torch", "cpu", 1.0, (1.0,), 1.0, False, 1.0, False, None, None, 1
    )
    with pytest.raises(AttributeError):
        row.median_s = 2.0  # type: ignore[misc]


def test_quick_and_explicit_batch_sizes() -> None:
    parser = cli.build_parser()
    config, _ = commands.sweep_config(parser.parse_args(["bench", "--quick"]))
    assert config.batch_sizes == cli.QUICK_BATCH_SIZES
    assert config.repeats == cli.QUICK_REPEATS
    config, _ = commands.sweep_config(parser.parse_args(["bench"]))
    assert config.batch_sizes == harness.DEFAULT_BATCH_SIZES == (1, 8, 64, 1024, 4096)
    args = parser.parse_args(["bench", "--quick", "--batch-sizes", "8,2,8"])
    assert commands.sweep_config(args)[0].batch_sizes == (2, 8)


def test_the_cli_imports_only_light_names_from_bench() -> None:
    import ast

    tree = ast.parse(Path(cli.__file__).read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    from_bench = {n.rsplit(".", 1)[0] for n in names if n.startswith("kvhit.bench.")}
    light = {"names", "peers", "traces", "workloads", "harness", "coordinator"}
    assert from_bench and {m.split(".")[2] for m in from_bench} <= light, from_bench
    # harness and kernels.checks only inside the --device check, after
    # parsing: help never reaches them.
    top = {
        f"{node.module}"
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.module
    }
    assert not {m for m in top if m.endswith(("harness", "commands", "checks"))}
    assert "torch" not in top and "numpy" not in top


def test_quiet_runs_need_no_tqdm(monkeypatch: pytest.MonkeyPatch) -> None:
    # A GPU box running from a source tree may have only torch and triton.
    monkeypatch.setitem(sys.modules, "tqdm", None)
    assert cli.main([*TINY_BENCH, "--presets", "llama", "--batch-sizes", "2"]) == 0
    assert cli.main(TINY_DEMO) == 0


# -- bad input: exit 2 naming the argument, never a traceback (issue 35) --------

GOOD_LINE = '{"timestamp": 0, "input_length": 600, "hash_ids": [1, 2]}\n'


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str], *needles: str) -> str:
    """Runs ``argv``; asserts exit 2, no traceback and each needle in stderr."""
    capsys.readouterr()
    err = _usage_error(argv, capsys)
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any work (a workload, a sweep, a replay) fails the test: the argument
    must be refused first."""
    from kvhit.bench import replay as replay_mod
    from kvhit.bench import route as route_mod

    monkeypatch.setattr(harness, "generate", _must_not_run)
    monkeypatch.setattr(harness, "sweep", _must_not_run)
    monkeypatch.setattr(replay_mod, "replay", _must_not_run)
    monkeypatch.setattr(route_mod, "replay", _must_not_run)


@pytest.mark.parametrize("command", ["replay", "route"])
def test_a_missing_trace_exits_2(command, tmp_path, capsys, no_work) -> None:
    # Regression: `kvhit route --trace missing.jsonl` ended in a traceback, exit 3.
    _refused([command, str(tmp_path / "missing.jsonl")], capsys, "TRACE", "missing")


def test_route_trace_option_is_a_deprecated_alias(tmp_path, capsys, no_work) -> None:
    missing = str(tmp_path / "missing.jsonl")
    with pytest.warns(FutureWarning, match="deprecated"):
        _refused(["route", "--trace", missing], capsys, "TRACE", "missing")
    _refused(["route", missing, "--trace", missing], capsys, "--trace")


@pytest.mark.parametrize("command", ["replay", "route"])
def test_a_malformed_json_line_exits_2(command, tmp_path, capsys, no_work) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(GOOD_LINE + '{"timestamp": 1, "input_length":\n')
    _refused([command, str(bad)], capsys, "TRACE", "bad.jsonl:2", "not JSON")


@pytest.mark.parametrize("command", ["replay", "route"])
def test_a_missing_field_is_named(command, tmp_path, capsys, no_work) -> None:
    # Regression: "'timestamp' must be an int, got None".
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input_length": 600, "hash_ids": [1, 2]}\n')
    _refused([command, str(bad)], capsys, "bad.jsonl:1", "'timestamp' is missing")
    bad.write_text('{"timestamp": 0, "input_length": -3, "hash_ids": [1, 2]}\n')
    _refused([command, str(bad)], capsys, "'input_length'", ">= 0")


def _gz(path: Path, text: str) -> bytes:
    import gzip

    data = gzip.compress(text.encode())
    path.write_bytes(data)
    return data


@pytest.mark.parametrize("command", ["replay", "route"])
def test_a_truncated_gz_trace_exits_2(command, tmp_path, capsys, no_work) -> None:
    # Regression: EOFError with a traceback, exit 3.
    trace = tmp_path / "t.jsonl.gz"
    data = _gz(trace, GOOD_LINE * 200)
    trace.write_bytes(data[: len(data) // 2])
    _refused([command, str(trace)], capsys, "TRACE", "truncated")


@pytest.mark.parametrize("command", ["replay", "route"])
def test_a_corrupt_gz_trace_exits_2(command, tmp_path, capsys, no_work) -> None:
    # Regression: zlib.error with a traceback, exit 3.
    trace = tmp_path / "t.jsonl.gz"
    data = bytearray(_gz(trace, GOOD_LINE * 200))
    data[20:40] = b"\xff" * 20  # inside the deflate stream
    trace.write_bytes(bytes(data))
    _refused([command, str(trace)], capsys, "TRACE", "corrupt")
    trace.write_bytes(b"not gzip at all\n")  # a bad header
    _refused([command, str(trace)], capsys, "TRACE", "corrupt")


@pytest.mark.parametrize("command", ["replay", "route"])
def test_an_empty_trace_exits_2(command, tmp_path, capsys, no_work) -> None:
    # Regression: an empty trace "succeeded" with 0 requests, exit 0.
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    _refused([command, str(empty)], capsys, "TRACE", "no request")
    _gz(tmp_path / "empty.jsonl.gz", "")
    _refused([command, str(tmp_path / "empty.jsonl.gz")], capsys, "no request")


@pytest.mark.parametrize("value", ["nan", "-1", "inf", "x"])
def test_route_overlap_weight_must_be_a_finite_non_negative_number(
    value, capsys, no_work
) -> None:
    # Regression: nan and -1 ended in a traceback, exit 3.
    _refused(["route", "--overlap-weight", value], capsys, "--overlap-weight")


@pytest.mark.parametrize("value", ["-5", "nan"])
def test_route_tpot_ms_must_be_non_negative(value, capsys, no_work) -> None:
    # Regression: --tpot-ms -5 was accepted and changed the results.
    _refused(["route", "--tpot-ms", value], capsys, "--tpot-ms")


@pytest.mark.parametrize(
    "flag, value",
    [("--check-every", "-3"), ("--engines", "0"), ("--limit", "0"), ("--batch", "0")],
)
def test_route_counts_must_be_in_range(flag, value, capsys, no_work) -> None:
    # Regression: --check-every -3 was accepted.
    _refused(["route", flag, value], capsys, flag)


@pytest.mark.parametrize("value", ["nan", "-0.5"])
def test_workload_history_must_be_a_finite_non_negative_number(
    value, capsys, no_work
) -> None:
    _refused(["demo", "--history", value], capsys, "--history")


def _no_cuda() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")


@pytest.mark.parametrize("command", ["demo", "bench"])
def test_device_cuda_without_cuda_exits_2(command, capsys, no_work) -> None:
    # Regression: demo: a traceback, exit 3; bench: timed the reference loop only.
    _no_cuda()
    _refused([command, "--device", "cuda"], capsys, "--device", "CUDA")
    _refused([command, "--device", "nonsense"], capsys, "--device")


@pytest.mark.parametrize(
    "argv", [["demo", "--backend", "triton"], ["bench", "--backends", "torch,triton"]]
)
def test_triton_without_cuda_exits_2(argv, capsys, monkeypatch, no_work) -> None:
    # Regression: kvhit demo --backend triton: a traceback, exit 3.
    _no_cuda()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    _refused(argv, capsys, argv[1], "triton needs a CUDA device")


def test_route_writes_json_and_plot(tmp_path, capsys) -> None:
    pytest.importorskip("matplotlib")
    out_json, png = tmp_path / "r.json", tmp_path / "r.png"
    argv = ["route", "--preset", "llama", "--engines", "2", "--limit", "24", "-q"]
    assert cli.main([*argv, "--json", str(out_json), "--plot", str(png)]) == 0
    doc = json.loads(out_json.read_text())
    assert [r["router"] for r in doc["routers"]] == list(cli.ROUTERS)
    for r in doc["routers"]:
        assert r["requests"] == 24
        assert r["hit_rate"] == r["hit_tokens"] / r["prompt_tokens"]
    assert doc["config"]["limit"] == 24 and doc["config"]["engines"] == 2
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert all(f"| {name} " in out for name in cli.ROUTERS)
    # round-robin's busiest engine / mean as formatted ("1.00", not "1").
    assert next(ln for ln in out.splitlines() if "round-robin" in ln).endswith(
        " 1.00 |"
    )


def test_route_defaults_reproduce_the_readme_table(capsys) -> None:
    args = cli.build_parser().parse_args(["route"])
    config = commands.route_config(args)
    # README's table: E = 8, the first 3000 requests, 8 at a time.
    assert (config.engines, config.limit, config.batch) == (8, 3000, 8)
    assert (config.tpot_ms, config.overlap_weight, config.check_every) == (20, 1, 50)
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert "first 3000 requests routed 8 at a time" in readme
    with pytest.raises(SystemExit):
        cli.main(["route", "--help"])
    help_text = capsys.readouterr().out
    for default in ("(default: 3000)", "(default: 8)", "(default: 20.0)"):
        assert default in help_text


def test_the_light_names_agree_with_the_modules_that_use_them() -> None:
    # bench/names.py repeats these so that --help imports neither torch nor numpy.
    from kvhit.bench import names, peers, workloads
    from kvhit.coordinator.engine import BACKEND_CLASSES

    assert set(names.ENGINE_BACKENDS) == set(BACKEND_CLASSES) - {"reference"}
    assert names.PEERS == peers.PEERS
    assert list(names.PRESET_DESCRIPTIONS) == list(workloads.PRESETS)
    for name, preset in workloads.PRESETS.items():
        assert preset.description == names.PRESET_DESCRIPTIONS[name]


def test_help_answers_without_torch() -> None:
    # kvhit --help and every subcommand's --help: no torch, numpy, numba or
    # triton imported (kvhit --help took 2-4 s when every command imported
    # torch first).
    code = (
        "import sys, contextlib, io\n"
        "from kvhit import cli\n"
        "for argv in ([], ['demo'], ['bench'], ['replay'], ['route']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()):\n"
        "        try:\n"
        "            cli.main([*argv, '--help'])\n"
        "        except SystemExit:\n"
        "            pass\n"
        "heavy = {'torch', 'numpy', 'numba', 'triton', 'matplotlib'}\n"
        "print(sorted(heavy & set(sys.modules)))\n"
    )
    assert run_python(code, 60).strip() == "[]"


@pytest.mark.timing
def test_help_answers_in_half_a_second() -> None:
    import time

    best = float("inf")
    for argv in (["--help"], ["route", "--help"]):
        for _ in range(3):  # the best of three: a busy host's noise
            t0 = time.perf_counter()
            subprocess.run(
                [sys.executable, "-m", "kvhit", *argv],
                capture_output=True,
                check=True,
                timeout=60,
            )
            best = min(best, time.perf_counter() - t0)
        assert best < 0.5, (argv, best)
        best = float("inf")


def test_the_bench_table_fits_every_preset_name() -> None:
    # Regression: dsv4-longhit overflowed the fixed-width preset column.
    from kvhit.bench import report

    def row(preset: str, b: int) -> harness.ResultRow:
        return harness.ResultRow(
            preset, b, "numba", "cpu", 1e-4, (1e-4,), b / 1e-4, False, 12.0, False,
            None, 2e-6, b,
        )  # fmt: skip

    rows = (row("llama", 1), row("dsv4-longhit", 4096))
    config = harness.SweepConfig(presets=("llama", "dsv4-longhit"))
    result = harness.SweepResult(config, rows, (), (), {})
    table = report.format_table(result).splitlines()
    lines = [ln for ln in table if " numba " in ln and ln.startswith("  ")]
    assert len(lines) == 2
    # Every column starts at the same offset on both lines.
    assert lines[0].index(" numba ") == lines[1].index(" numba ")
    assert lines[0].index("12.0x") == lines[1].index("12.0x")
