"""`tandem bench compare --peer vllm|llamacpp|tandem` (tandem.bench.peers) without running any peer:
the parser and its errors, the dispatch and --json, the report tables from hand-written raw runs,
and that the scripts reusing the comparison import names the package has. The parts beyond the
offline and served comparison (spec, plugin, one-stream, variants): test_bench_compare_parts.py.
`no_peer_runs`: conftest.py."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

import tandem.bench.peers as peers
from tandem.bench.peers.cli import compare_options
from tandem.bench.peers import llamacpp, report
from tandem.bench.peers import vllm as vllm_peer
from tandem.cli import build_parser, main


def parse(*argv: str):
    return build_parser().parse_args(["bench", "compare", *argv])


# --- the parser -----------------------------------------------------------------------------------

def test_vllm_peer_gets_the_old_scripts_defaults(tmp_path):
    a = parse("--peer", "vllm", "--out", str(tmp_path))
    compare_options(a)
    assert a.func.__name__ == "cmd_bench_compare"
    assert (a.peer, a.parts, a.rates, a.seeds, a.num_prompts) == ("vllm", "offline,prompts,serve", [1.0, 2.0, 4.0],
                                                                   [0, 1, 2], 64)
    assert (a.prompts_per_kind, a.offline_prompts, a.offline_repeats, a.offline_temperatures) == (3, 64, 3, "0,1")
    assert (a.warmup_requests, a.ttft_ms, a.tpot_ms, a.tandem_args) == (4, 2000, 100, "")
    assert (a.vllm_memory_fraction, a.vllm_preload, a.vllm_reserved_cpus) == (0.5, True, 0)
    assert (a.model, a.load_format, a.dtype, a.report_only, a.json) == (None, "auto", "auto", False, None)
    assert not hasattr(a, "slots") and not hasattr(a, "llama_server")


def test_vllm_options_are_taken():
    a = parse("--peer", "vllm", "--parts", "serve", "--rates", "0.5,2", "--seeds", "3", "--no-vllm-preload",
              "--vllm-reserved-cpus", "-1", "--model", "llama-3.2-1b", "--load-format", "dummy", "--report-only",
              "--json", "s.json")
    compare_options(a)
    assert (a.parts, a.rates, a.seeds, a.vllm_preload, a.vllm_reserved_cpus) == ("serve", [0.5, 2.0], [3], False, -1)
    assert (a.model, a.load_format, a.report_only, a.json) == ("llama-3.2-1b", "dummy", True, "s.json")


def test_llamacpp_peer_gets_the_old_scripts_defaults():
    a = parse("--peer", "llamacpp", "--llama-server", "/opt/llama-server")
    compare_options(a)
    assert (a.llama_server, a.slots, a.engines, a.rates, a.seeds) == ("/opt/llama-server", 16, "llamacpp,tandem",
                                                                       [2.0, 4.0], [0, 1, 2])
    assert (a.parts, a.llama_bench, a.model, a.rounds, a.max_tokens) == ("serve", None, None, 3, 128)
    assert not hasattr(a, "load_format") and not hasattr(a, "vllm_preload")


@pytest.mark.skipif(peers.ROOT is None, reason="not a source checkout")
@pytest.mark.parametrize("peer,extra", [("vllm", []), ("llamacpp", ["--llama-server", "x"])])
def test_default_out_is_the_checkouts_results_folder(peer, extra):
    a = parse("--peer", peer, *extra)
    compare_options(a)
    assert Path(a.out) == peers.ROOT / "docs" / "results" / f"compare_{peer}" / "latest"


def test_outside_a_checkout_out_is_required(monkeypatch):
    """Without a source checkout: --out must be given, and only the served part runs (the offline and
    prompt-set parts need scripts/offline_run.py)."""
    monkeypatch.setattr(peers, "ROOT", None)
    with pytest.raises(ValueError, match="--out is required"):
        compare_options(parse("--peer", "vllm", "--parts", "serve"))
    with pytest.raises(ValueError, match="run them from a source checkout"):
        compare_options(parse("--peer", "vllm", "--out", "here"))
    a = parse("--peer", "vllm", "--parts", "serve", "--out", "here")
    compare_options(a)
    assert a.out == "here"
    assert peers.tandem_bin().endswith("tandem")


def test_unknown_peer_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        parse("--peer", "sglang")
    assert e.value.code == 2
    assert "argument --peer: invalid choice: 'sglang'" in capsys.readouterr().err


def test_peer_is_required(capsys):
    with pytest.raises(SystemExit) as e:
        parse()
    assert e.value.code == 2
    assert "--peer" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--peer", "llamacpp"], "--peer llamacpp needs --llama-server PATH"),
    (["--peer", "vllm", "--slots", "4"], "--slots: only for --peer llamacpp"),
    (["--peer", "llamacpp", "--llama-server", "x", "--load-format", "dummy", "--no-vllm-preload"],
     "--load-format, --no-vllm-preload: only for --peer vllm"),
    (["--peer", "vllm", "--llama-bench", "x"], "--llama-bench: only for --peer llamacpp"),
    (["--peer", "llamacpp", "--llama-server", "x", "--parts", "offline"], "--parts: a comma-separated subset of serve, one-stream"),
    (["--peer", "llamacpp", "--parts", "one-stream"], "--parts one-stream needs --llama-bench PATH"),
    (["--peer", "llamacpp", "--parts", "one-stream", "--llama-bench", "b", "--model", "1b=/no/such.gguf"],
     "--model: no GGUF file '/no/such.gguf'"),
    (["--peer", "llamacpp", "--llama-server", "x", "--model", "a=default,b=default"],
     "--model: the served part runs one GGUF file"),
    (["--peer", "vllm", "--parts", "serve", "--max-concurrency", "0"], "--max-concurrency: at least 1"),
    (["--peer", "vllm", "--parts", "spec", "--spec-systems", "vllm-eagle"], "--spec-systems: unknown vllm-eagle"),
    (["--peer", "vllm", "--parts", "spec", "--workloads", "gsm8k"], "--workloads: unknown gsm8k"),
    (["--peer", "vllm", "--parts", "spec", "--concurrency", "one"], "--concurrency and --temperatures: comma-sep"),
    (["--peer", "vllm", "--parts", "plugin-serve", "--plugin-options", "{bad"], "--plugin-options: not JSON"),
    (["--peer", "vllm", "--parts", "plugin-agents", "--trace", "/no/trace.jsonl"], "--parts plugin-agents needs --trace"),
    (["--peer", "llamacpp", "--llama-server", "x", "--spec-systems", "vllm-none"], "--spec-systems: only for --peer vllm"),
    (["--peer", "tandem", "--variants", "a=--x"], "--peer tandem needs two --variants"),
    (["--peer", "tandem", "--variants", "a=", "--variants", "a=--x"], "--variants: 'a' given twice"),
    (["--peer", "tandem", "--variants", "a=", "--variants", "bx"], "--variants: NAME=FLAGS, got 'bx'"),
    (["--peer", "tandem", "--variants", "a=", "--variants", "b=", "--parts", "serve"],
     "--parts: only for --peer vllm or llamacpp"),
    (["--peer", "vllm", "--variants", "a="], "--variants: only for --peer tandem"),
    (["--peer", "llamacpp", "--llama-server", "x", "--engines", "llamacpp,sglang"], "--engines: a comma-separated"),
    (["--peer", "vllm", "--parts", "serve,offlne"], "--parts: a comma-separated subset"),
    (["--peer", "vllm", "--rates", "2,fast"], "--rates and --seeds: comma-separated numbers"),
])
def test_bad_options_exit_2_before_anything_runs(argv, message, capsys, no_peer_runs, tmp_path):
    assert main(["bench", "compare", *argv, "--out", str(tmp_path)]) == 2
    assert f"tandem bench compare: error: {message}" in capsys.readouterr().err
    assert no_peer_runs == []


@pytest.mark.parametrize("peer,extra,rates", [("vllm", [], [1.0, 2.0, 4.0]),
                                              ("llamacpp", ["--llama-server", "x"], [2.0, 4.0]),
                                              ("tandem", ["--variants", "a=", "--variants", "b="], [1.0, 2.0, 4.0])])
def test_dispatch_to_the_peer_and_json(peer, extra, rates, tmp_path, no_peer_runs, capsys):
    path = tmp_path / "sub" / "summary.json"
    assert main(["bench", "compare", "--peer", peer, *extra, "--out", str(tmp_path / "out"),
                 "--json", str(path)]) == 0
    (a,) = no_peer_runs
    assert (a.peer, a.rates, a.out) == (peer, rates, str(tmp_path / "out"))
    assert json.loads(path.read_text()) == {"peer": peer, "rates": rates}
    assert f"results written to {path}" in capsys.readouterr().out


# --- the reports ----------------------------------------------------------------------------------

VLLM_SERVE = {0: {"request_goodput": 0.0, "request_throughput": 1.0, "output_throughput": 100.0, "median_ttft_ms": 200.0,
                  "p99_ttft_ms": 1000.0, "median_tpot_ms": 50.0, "p99_tpot_ms": 90.0, "median_itl_ms": 40.0,
                  "completed": 32, "itls": [[1.0]]},
              1: {"request_goodput": 0.0, "request_throughput": 2.0, "output_throughput": 140.0, "median_ttft_ms": 400.0,
                  "p99_ttft_ms": 1200.0, "median_tpot_ms": 70.0, "p99_tpot_ms": 110.0, "median_itl_ms": 60.0,
                  "completed": 31}}
TANDEM_SERVE = {0: {"request_goodput": 1.0, "request_throughput": 2.0, "output_throughput": 150.0,
                    "median_ttft_ms": 100.0, "p99_ttft_ms": 550.0, "median_tpot_ms": 30.0, "median_itl_ms": 25.0,
                    "completed": 32},
                1: {"request_goodput": 1.5, "request_throughput": 2.0, "output_throughput": 210.0,
                    "median_ttft_ms": 200.0, "p99_ttft_ms": 550.0, "median_tpot_ms": 30.0, "median_itl_ms": 35.0,
                    "completed": 32}}


def write_raw(raw: Path) -> None:
    """A comparison's raw folder as peers.vllm writes it: every part, seeds 0 and 1 of rate 2 (no seed 2)."""
    raw.mkdir(parents=True)
    for name, tok_s in {"vllm-t0": 100.0, "tandem-t0": 150.0, "vllm-t1": 80.0, "tandem-t1": 100.0}.items():
        (raw / f"offline-{name}.json").write_text(json.dumps({"output_tok_s": tok_s, "repeats": [tok_s]}))
    for tag, (seq, batch) in {"vllm": (20.0, 50.0), "tandem": (40.0, 100.0), "vllm-ngram": (25.0, 40.0),
                              "tandem-ngram": (60.0, 90.0)}.items():
        (raw / f"prompts-{tag}.json").write_text(json.dumps({"sequential": {"output_tok_s": seq},
                                                            "batch": {"output_tok_s": batch}}))
    for name, runs in (("vllm", VLLM_SERVE), ("tandem", TANDEM_SERVE)):
        for seed, d in runs.items():
            (raw / f"serve-{name}-rate2-seed{seed}.json").write_text(json.dumps(d))


def table_rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("| ") and not line.startswith(("| sampling", "| model",
                                                                                                 "| run", "| rate"))]


def test_from_raw_reads_the_runs_present(tmp_path):
    write_raw(tmp_path / "raw")
    got = report.from_raw(SimpleNamespace(rates=[2.0], seeds=[0, 1, 2]), tmp_path / "raw")
    assert got["offline"] == {"vllm-t0": 100.0, "vllm-t1": 80.0, "tandem-t0": 150.0, "tandem-t1": 100.0}
    assert got["prompts"] == {"vllm": {"sequential": 20.0, "batch": 50.0}, "tandem": {"sequential": 40.0, "batch": 100.0},
                              "vllm-ngram": {"sequential": 25.0, "batch": 40.0},
                              "tandem-ngram": {"sequential": 60.0, "batch": 90.0}}
    assert got["seeds"] == [0, 1]
    assert got["serve"]["vllm"]["2.0"][0] == {k: v for k, v in VLLM_SERVE[0].items() if k != "itls"}
    assert got["serve"]["tandem"]["2.0"][1]["p99_tpot_ms"] is None          # a figure the run lacks
    assert len(got["serve"]["tandem"]["2.0"]) == 2


def test_markdown_tables_of_a_fixture(tmp_path):
    write_raw(tmp_path / "raw")
    data = {"machine": "test box", "dtype": "float32", "peer_version": "0.32.0", "model": "/m/SmolLM2",
            "load_format": "auto", "rates": [2.0], "num_prompts": 32, "offline_prompts": 64, "ttft_ms": 2000,
            "tpot_ms": 100, "prompts_per_kind": 3, "vllm_env": {}}
    data.update(report.from_raw(SimpleNamespace(rates=[2.0], seeds=[0, 1, 2]), tmp_path / "raw"))
    text = report.markdown(data)
    assert text.startswith("Tandem vs vLLM 0.32.0 CPU build on SmolLM2, same machine, one after the other "
                           "(test box, dtype float32);")
    assert "seeds [0, 1]; goodput: TTFT <= 2000 ms and TPOT <= 100 ms:" in text
    assert table_rows(text) == [
        "| greedy | 100.0 | 150.0 | 1.50 |",
        "| temperature 1 | 80.0 | 100.0 | 1.25 |",
        "| one at a time, no speculation | 20.0 | 40.0 | 2.00 |",
        "| one at a time, n-gram | 25.0 | 60.0 | 2.40 |",
        "| one at a time, Tandem n-gram vs vLLM's best | 25.0 | 60.0 | 2.40 |",
        "| all at once, no speculation | 50.0 | 100.0 | 2.00 |",
        "| all at once, n-gram | 40.0 | 90.0 | 2.25 |",
        "| all at once, Tandem n-gram vs vLLM's best | 50.0 | 90.0 | 1.80 |",
        "| 2 | goodput req/s | 0.00 | 1.25 | n/a |",          # the peer's median is 0: no ratio
        "| 2 | req/s | 1.50 | 2.00 | 1.33 |",
        "| 2 | output tok/s | 120.00 | 180.00 | 1.50 |",
        "| 2 | TTFT p50 ms | 300.00 | 150.00 | 0.50 |",
        "| 2 | TTFT p99 ms | 1100.00 | 550.00 | 0.50 |",
        "| 2 | TPOT p50 ms | 60.00 | 30.00 | 0.50 |",
        "| 2 | TPOT p99 ms | 100.0 | None | n/a |",           # Tandem's runs lack it
        "| 2 | ITL p50 ms | 50.00 | 30.00 | 0.60 |",
    ]


def test_markdown_of_an_interrupted_run_has_only_its_parts(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "offline-vllm-t0.json").write_text(json.dumps({"output_tok_s": 10.0}))
    (raw / "offline-tandem-t0.json").write_text(json.dumps({"output_tok_s": 12.0}))
    got = report.from_raw(SimpleNamespace(rates=[1.0], seeds=[0]), raw)
    assert got == {"offline": {"vllm-t0": 10.0, "tandem-t0": 12.0}}
    text = report.markdown({"machine": "m", "dtype": "bfloat16", "peer_version": "?", "offline_prompts": 8, **got})
    assert table_rows(text) == ["| greedy | 10.0 | 12.0 | 1.20 |"]
    assert "vllm bench serve" not in text and "prompt set" not in text


def test_llamacpp_markdown():
    data = {"llama_version": "version: 1 (abc)", "machine": "m", "seeds": [0, 1], "num_prompts": 64, "ttft_ms": 2000,
            "tpot_ms": 100, "medians": {"4.0": {"llamacpp": {"request_goodput": 2.0, "median_ttft_ms": 400.0},
                                                "tandem": {"request_goodput": 3.0, "median_ttft_ms": 100.0}}}}
    rows = table_rows(llamacpp.markdown(data))
    assert rows[0] == "| 4 | goodput req/s | 2.00 | 3.00 | 1.50 |"
    assert rows[3] == "| 4 | TTFT p50 ms | 400.00 | 100.00 | 0.25 |"
    assert rows[1] == "| 4 | req/s | None | None | n/a |"
    assert len(rows) == len(report.SERVE_METRICS)
    assert "Failed requests" not in llamacpp.markdown(data)
    data["runs"] = {"llamacpp": {"4.0": [{"failed": 1}, {"failed": 0}]}, "tandem": {"4.0": [{"failed": 0}, {}]}}
    assert "llamacpp at rate 4.0: [1, 0]; tandem at rate 4.0: [0, 0]" in llamacpp.markdown(data)


def test_llamacpp_serves_the_chosen_gguf_under_one_name(monkeypatch, tmp_path):
    """Both servers get --model's file under the default model's name (the tokenizer `vllm bench
    serve` counts with); --slots and --max-concurrency reach the table."""
    gguf = tmp_path / "1b.gguf"
    gguf.write_bytes(b"GGUF")
    model_dir = tmp_path / "SmolLM2-135M-Instruct"
    monkeypatch.setattr(llamacpp, "default_model", lambda: (model_dir, tmp_path / "default.gguf"))
    monkeypatch.setattr(llamacpp, "llama_version", lambda binary: "version: 1 (abc)")
    seen = {}

    def rounds(a, peer, model, servers, raw):
        seen.update(servers=servers, model=model)
        return {name: {"inf": [{"request_goodput": 1.0}]} for name in servers}

    monkeypatch.setattr(llamacpp, "serve_rounds", rounds)
    a = parse("--peer", "llamacpp", "--llama-server", "/opt/llama-server", "--model", f"1b={gguf}", "--slots", "4",
              "--rates", "inf", "--max-concurrency", "4", "--out", str(tmp_path / "out"))
    compare_options(a)
    data = llamacpp.serve(a, tmp_path)
    llama, tandem = seen["servers"]["llamacpp"][0], seen["servers"]["tandem"][0]
    assert llama[llama.index("-m") + 1] == str(gguf) and llama[llama.index("--alias") + 1] == model_dir.name
    assert llama[llama.index("--parallel") + 1] == "4" and llama[llama.index("-c") + 1] == "8192"
    assert tandem[1:6] == ["serve", "--model", str(gguf), "--served-model-name", model_dir.name]
    assert seen["model"] == model_dir and (data["model"], data["max_concurrency"], data["slots"]) == ("1b", 4, 4)
    assert "1b, ShareGPT" in llamacpp.markdown({**data, "machine": "m"})
    assert "at most 4 in flight" in llamacpp.markdown({**data, "machine": "m"})
    a.model = None      # the default model: Tandem serves its converted directory, llama.cpp its GGUF
    llamacpp.serve(a, tmp_path)
    llama, tandem = seen["servers"]["llamacpp"][0], seen["servers"]["tandem"][0]
    assert llama[llama.index("-m") + 1] == str(tmp_path / "default.gguf") and tandem[3] == str(model_dir)


def test_bench_serve_passes_max_concurrency_and_keeps_the_errors(monkeypatch, tmp_path):
    commands = []

    def run(cmd, **kw):
        commands.append(cmd)
        result = {"failed": 1, "errors": ["", "Traceback ... " + "x" * 600 + "UnicodeDecodeError"], "itls": [[1.0]]}
        Path(cmd[cmd.index("--result-dir") + 1], cmd[cmd.index("--result-filename") + 1]).write_text(json.dumps(result))

    monkeypatch.setattr(vllm_peer.subprocess, "run", run)
    a = SimpleNamespace(num_prompts=8, ttft_ms=2000, tpot_ms=100, max_concurrency=4)
    for bound in (4, None):
        a.max_concurrency = bound
        got = vllm_peer.bench_serve(a, Path("/peer"), Path("/m/M"), Path("/d.json"), 18001, float("inf"), 0,
                                    tmp_path / "r.json")
        assert got["failed"] == 1
    assert commands[0][commands[0].index("--request-rate") + 1] == "inf"
    assert commands[0][-2:] == ["--max-concurrency", "4"] and "--max-concurrency" not in commands[1]
    saved = json.loads((tmp_path / "r.json").read_text())
    assert list(saved["errors"]) == ["1"] and len(saved["errors"]["1"]) == 500
    assert saved["errors"]["1"].endswith("UnicodeDecodeError") and "itls" not in saved


def test_sample_seed_gives_each_rate_its_own_prompts():
    assert [vllm_peer.sample_seed(s, i) for s in (0, 1) for i in (0, 1, 2)] == [0, 1, 2, 1000, 1001, 1002]


def test_server_commands():
    model = Path("/m/SmolLM2")
    assert vllm_peer.vllm_serve_cmd(Path("/peer"), model, "bfloat16", 18000, 0.5)[:3] == ["/peer/bin/vllm", "serve",
                                                                                         "/m/SmolLM2"]
    cmd = vllm_peer.tandem_serve_cmd(model, 18001, "dummy")
    assert cmd[1:] == ["serve", "--model", "/m/SmolLM2", "--port", "18001", "--load-format", "dummy"]
    assert cmd[0] == peers.tandem_bin()


# --- the package and the scripts --------------------------------------------------------------------

PEERS_DIR = Path(peers.__file__).resolve().parent


@pytest.mark.parametrize("path", sorted(PEERS_DIR.glob("*.py")), ids=lambda p: p.name)
def test_peers_never_import_vllm_and_stay_short(path):
    """The peers run as subprocesses: Tandem's interpreter never imports vLLM."""
    tree = ast.parse(path.read_text())
    names = [n.name for node in ast.walk(tree) if isinstance(node, ast.Import) for n in node.names]
    names += [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and not node.level]
    assert not [n for n in names if n.split(".")[0] == "vllm"], path.name
    assert len(path.read_text().splitlines()) < 400


@pytest.mark.skipif(peers.ROOT is None, reason="not a source checkout")
def test_scripts_import_the_comparison_from_the_package():
    """scripts/ that reuse the comparison import names tandem.bench.peers has; none imports the old scripts."""
    import importlib

    scripts = peers.ROOT / "scripts"
    for gone in ("compare_vllm.py", "compare_vllm_report.py", "compare_llamacpp.py", "compare_spec_vllm.py",
                 "compare_vllm_plugin.py", "shapes_llamacpp.py", "one_stream_llamacpp.py", "one_stream_vllm.py",
                 "serve_ab.py"):
        assert not (scripts / gone).exists(), gone
    assert (scripts / "offline_run.py").is_file()                 # run by path under vLLM's interpreter
    users = 0
    for path in sorted(scripts.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                assert not [n.name for n in node.names if n.name.startswith("compare_")], path.name
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("compare_"), path.name
                if node.module.startswith("tandem.bench.peers"):
                    users += 1
                    module = importlib.import_module(node.module)
                    missing = [n.name for n in node.names if not hasattr(module, n.name)]
                    assert not missing, f"{path.name}: {missing}"
    assert users >= 1       # replicas_ab
