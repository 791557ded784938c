"""`tandem bench compare`'s parts beyond the offline and served comparison, without running any peer:
vLLM's spec and plugin parts, llama.cpp's one-stream part and Tandem's variants (their options, the
servers they start, their tables)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from tandem.bench.peers import llamacpp
from tandem.bench.peers.cli import compare_options
from tandem.cli import main
from tandem.models.fetch import DEFAULT_GGUF_MEMBER
from test_bench_compare import parse, table_rows


def test_vllm_spec_and_plugin_parts_get_the_old_scripts_defaults(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("{}\n")
    a = parse("--peer", "vllm", "--parts", "spec,plugin-agents,plugin-serve", "--trace", str(trace))
    compare_options(a)
    assert (a.workloads, a.concurrency, a.temperatures) == ("sharegpt,humaneval-edit,humaneval-tools", [1, 8], [1.0, 0.0])
    assert a.spec_systems == "vllm-none,vllm-ngram2,vllm-ngram5,tandem-none,tandem-ngram,tandem-suffix"
    assert (a.prompts_per_stream, a.min_prompts, a.add) == (3, 8, False)
    assert (a.plugin_systems, a.agent_repeats, a.trace, a.plugin_options, a.slo_scale) == ("vllm,vllm-tandem", 3,
                                                                                          str(trace), "{}", 5.0)
    argv = ("--peer", "vllm", "--parts", "spec", "--spec-systems", "vllm-ngram-table,vllm-ngram3,tandem-suffix",
            "--concurrency", "1", "--temperatures", "0", "--out", str(tmp_path))
    a = parse(*argv)
    compare_options(a)
    assert (a.spec_systems, a.concurrency, a.temperatures) == ("vllm-ngram-table,vllm-ngram3,tandem-suffix", [1], [0.0])
    with pytest.raises(ValueError, match="--add: .*spec.json must hold a run of the same"):
        compare_options(parse(*argv, "--add"))
    (tmp_path / "spec.json").write_text(json.dumps({"workloads": ["sharegpt", "humaneval-edit", "humaneval-tools"],
                                                    "concurrency": [1], "temperatures": [0.0]}))
    compare_options(parse(*argv, "--add"))


def test_spec_and_plugin_servers(tmp_path):
    from tandem.bench.peers import plugin, spec

    a = SimpleNamespace(vllm_memory_fraction=0.5, load_format="auto", tandem_args="--max-num-seqs 8",
                        vllm_preload=False, vllm_reserved_cpus=0, plugin_options='{"hold_sessions": false}')
    model, peer = Path("/m/SmolLM2"), Path("/peer")
    cmd, port, env = spec.server_cmd(a, peer, model, "bfloat16", "vllm-ngram5")
    assert port == 18000 and cmd[cmd.index("--speculative-config") + 1] == json.dumps(
        {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4})
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16"
    cmd, port, env = spec.server_cmd(a, peer, model, "bfloat16", "tandem-suffix")
    assert (port, env) == (18001, None) and cmd[-4:] == ["--speculative", "suffix", "--max-num-seqs", "8"]
    assert "--speculative" not in spec.server_cmd(a, peer, model, "bfloat16", "tandem-none")[0]
    cmd, _, env = plugin.server(a, peer, model, "float32", "vllm-tandem", 18300, [])
    assert cmd[cmd.index("--scheduler-cls") + 1] == plugin.PLUGIN
    assert json.loads(cmd[cmd.index("--additional-config") + 1]) == {"tandem": {"hold_sessions": False}}
    assert (Path(env["PYTHONPATH"]) / "tandem" / "__init__.py").is_file()
    cmd, _, env = plugin.server(a, peer, model, "float32", "vllm", 18300, [])
    assert "--scheduler-cls" not in cmd and "--additional-config" not in cmd


def test_spec_report_ratios_and_report_only(tmp_path, no_peer_runs):
    """spec.md's ratios: Tandem's suffix drafts against the best vLLM system and against no
    speculation; --report-only rebuilds it from OUT/spec.json without running a peer."""
    run = lambda tok: {"sharegpt": {"1": {"1": {"output_throughput": tok}}}}      # noqa: E731
    data = {"machine": "m", "peer_version": "0.32", "dtype": "bfloat16", "workloads": ["sharegpt"],
            "temperatures": [1.0], "concurrency": [1], "systems": ["vllm-none", "vllm-ngram5", "tandem-none",
                                                                   "tandem-suffix"],
            "runs": {"vllm-none": run(40.0), "vllm-ngram5": run(50.0), "tandem-none": run(100.0),
                     "tandem-suffix": run(120.0)}}
    (tmp_path / "spec.json").write_text(json.dumps(data))
    assert main(["bench", "compare", "--peer", "vllm", "--parts", "spec", "--report-only", "--out", str(tmp_path)]) == 0
    rows = [r for r in (tmp_path / "spec.md").read_text().splitlines() if r.startswith("| sharegpt")]
    assert rows == ["| sharegpt | 1 | 1 | 40.0 | 50.0 | 100.0 | 120.0 | vllm-ngram5 | 2.40x | 1.20x |"]
    assert no_peer_runs == []


def test_tandem_peer_takes_named_variants(tmp_path):
    a = parse("--peer", "tandem", "--variants", "default=", "--variants", "b2048=--max-num-batched-tokens 2048",
              "--rates", "0.25,2", "--num-prompts", "24", "--out", str(tmp_path))
    compare_options(a)
    assert a.variants == {"default": [], "b2048": ["--max-num-batched-tokens", "2048"]}
    assert (a.rates, a.num_prompts) == ([0.25, 2.0], 24)


def test_variants_markdown_ratios_to_the_first():
    from tandem.bench.peers import variants

    data = {"machine": "m", "num_prompts": 24, "seeds": [0, 1], "ttft_ms": 2000, "tpot_ms": 100,
            "variants": {"default": "", "b2048": "--max-num-batched-tokens 2048"},
            "medians": {"2.0": {"default": {"request_goodput": 0.1, "median_ttft_ms": 400.0},
                                "b2048": {"request_goodput": 0.2, "median_ttft_ms": 100.0}}}}
    rows = table_rows(variants.markdown(data))
    assert rows[0] == "| 2 | goodput req/s | 0.10 | 0.20 (2.00x) |"
    assert rows[3] == "| 2 | TTFT p50 ms | 400.00 | 100.00 (0.25x) |"
    assert rows[1] == "| 2 | req/s | - | - |"


def test_llamacpp_one_stream_options(tmp_path):
    f = tmp_path / "1b.gguf"
    f.write_bytes(b"GGUF")
    a = parse("--peer", "llamacpp", "--parts", "one-stream", "--llama-bench", "/opt/llama-bench",
              "--model", f"default,1b={f}", "--rounds", "2", "--max-tokens", "32")
    compare_options(a)
    assert (a.parts, a.llama_bench, a.llama_server, a.rounds, a.max_tokens) == ("one-stream", "/opt/llama-bench",
                                                                                None, 2, 32)
    assert llamacpp.gguf_files(f"small={f},{f}") == {"small": f, "1b": f}
    assert llamacpp.gguf_spec("default") == {Path(DEFAULT_GGUF_MEMBER).stem: "default"}     # not fetched
    with pytest.raises(ValueError, match="two files named '1b'"):
        llamacpp.gguf_files(f"1b={f},{f}")


def test_one_stream_pairs_the_engines_per_round(tmp_path, monkeypatch):
    """Rounds alternate the engines per file; the table's figures are medians over rounds and the
    ratios are per round."""
    f = tmp_path / "1b.gguf"
    f.write_bytes(b"G" * 1000)
    calls = []
    ours, theirs = iter([40.0, 30.0, 50.0]), iter([20.0, 30.0, 25.0])

    def fake_tandem(path, max_tokens, out):
        calls.append(("tandem", path, max_tokens))
        return {"decode_tok_s": next(ours), "peak_rss_mb": 1024.0, "bandwidth_gbs": 40.0}

    def fake_bench(binary, path, max_tokens, threads):
        calls.append(("llamacpp", path, max_tokens))
        return {"tok_s": next(theirs)}

    monkeypatch.setattr(llamacpp, "tandem_one_stream", fake_tandem)
    monkeypatch.setattr(llamacpp, "llama_bench", fake_bench)
    monkeypatch.setattr(llamacpp, "llama_version", lambda binary: "version: 1 (abc)")
    a = SimpleNamespace(llama_bench="b", model=str(f), rounds=3, max_tokens=16)
    data = llamacpp.one_stream(a, tmp_path)
    assert calls == [("tandem", f, 16), ("llamacpp", f, 16)] * 3
    s = data["summary"]["1b"]
    assert (s["tandem_tok_s"], s["llamacpp_tok_s"], s["ratio"]) == (40.0, 25.0, 1.6)
    assert s["ratios_per_round"] == [2.0, 1.0, 2.0]
    assert s["rss_over_file_plus_kv"] == pytest.approx(1024 / (1024 + 1000 / 2**20))
    rows = table_rows(llamacpp.one_stream_markdown({**data, "machine": "m"}))
    assert rows == ["| 1b | 0.00 | 25.00 | 40.00 | **1.60x** (2.00, 1.00, 2.00) | 1024 MB, 1.00x file + KV |"]
