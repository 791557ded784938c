"""Command-line arguments of `tandem bench serve` and `agents` and `tandem simulate calibrate`,
and the commands themselves (kept out of cli.py; calibrate measures the real engine, so it is bench's,
not the simulator's)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Callable

DEFAULT_NUM_REQUESTS = 100
DESCRIPTION = """Load generator for any OpenAI-compatible endpoint (Tandem, vLLM, llama.cpp, ...).

    tandem bench serve --url http://127.0.0.1:8000 (--rate R | --rates R1,R2 | --concurrency C)
        [--duration S | --num-requests N] [--arrival poisson|gamma|diurnal|TRACE] [--burstiness CV]
        [--dataset prompts|sharegpt|humaneval|augmented[:TYPE]|FILE] [--endpoint chat|completions]
        [--max-tokens N] [--goodput ttft:MS tpot:MS e2el:MS] [--json PATH] [--plots DIR]
"""


def _rate(text: str) -> float:
    value = float(text)
    if value <= 0 or math.isnan(value):
        raise argparse.ArgumentTypeError(f"a rate must be positive, got {text}")
    return value


def _rates(text: str) -> list[float]:
    return [_rate(x) for x in text.split(",") if x.strip()]


def _add_target_args(p: argparse.ArgumentParser) -> None:
    """The server an HTTP benchmark drives: --url, --model, --api-key."""
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (with or without /v1)")
    p.add_argument("--model", default=None, help="model name to send (default: the first /v1/models lists)")
    p.add_argument("--api-key", default=None, help="sent as a Bearer token")


def add_serve_parser(bsub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    s = bsub.add_parser("serve", help="load generator for any OpenAI-compatible endpoint",
                        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_target_args(s)
    load = s.add_mutually_exclusive_group(required=True)
    load.add_argument("--rate", type=_rate, help="requests per second, open loop ('inf': all at once)")
    load.add_argument("--rates", type=_rates, help="comma-separated rates to sweep, one run each")
    load.add_argument("--concurrency", type=int, help="closed loop: this many requests in flight")
    s.add_argument("--duration", type=float, default=None, help="seconds during which requests are sent")
    s.add_argument("--num-requests", type=int, default=None,
                   help=f"requests per run (default {DEFAULT_NUM_REQUESTS} unless --duration is given)")
    s.add_argument("--arrival", default="poisson", help="poisson | gamma | diurnal | a CSV/JSONL trace file")
    s.add_argument("--burstiness", type=float, default=None,
                   help="gamma CV (>1 bursty); implies --arrival gamma")
    s.add_argument("--peak-valley-ratio", type=float, default=10.0, help="diurnal arrivals: peak/valley rate")
    s.add_argument("--dataset", default="prompts",
                   help="prompts | sharegpt | humaneval | augmented[:TYPE] | a JSON/JSONL file")
    s.add_argument("--tokenizer", default="auto",
                   help="token counting for dataset filters: auto (default model's, if cached) | none | PATH")
    s.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    s.add_argument("--max-tokens", type=int, default=None,
                   help="override each item's output length (not a tool trace's)")
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM/Tandem extension)")
    s.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="SLOs: ttft:MS tpot:MS e2el:MS")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--timeout", type=float, default=600.0, help="per-call timeout in seconds")
    s.add_argument("--json", default=None, help="write config, figures and per-request records here")
    s.add_argument("--plots", default=None, help="write PNG plots into this directory")
    s.add_argument("--no-progress", action="store_true")
    s.set_defaults(func=cmd_bench_serve)
    return s


def token_counter(spec: str) -> tuple[Callable[[str], int] | None, str]:
    """A token counter from a tokenizer.json (file or directory), and a description for the results."""
    if spec == "none":
        return None, "estimate"
    if spec == "auto":
        from tandem.models.fetch import DEFAULT_MODEL, cache_dir

        path = cache_dir() / "models" / DEFAULT_MODEL / "tokenizer.json"
        if not path.is_file():
            return None, "estimate"
    else:
        path = Path(spec).expanduser()
        path = path / "tokenizer.json" if path.is_dir() else path
        if not path.is_file():
            raise ValueError(f"no tokenizer.json at {spec}")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    return (lambda text: len(tok.encode(text, add_special_tokens=False).ids)), str(path)


def config_from_args(a: argparse.Namespace):
    from tandem.bench.serve import ServeBenchConfig
    from tandem.bench.serve_metrics import parse_goodput

    rates = a.rates or ([a.rate] if a.rate is not None else [])
    num = a.num_requests if (a.num_requests is not None or a.duration is not None) else DEFAULT_NUM_REQUESTS
    arrival = "gamma" if a.burstiness is not None and a.arrival == "poisson" else a.arrival
    return ServeBenchConfig(
        url=a.url, dataset=a.dataset, model=a.model, endpoint=a.endpoint, rates=rates,
        concurrency=a.concurrency,
        num_requests=num, duration_s=a.duration, arrival=arrival, burstiness=a.burstiness or 1.0,
        peak_valley_ratio=a.peak_valley_ratio, max_tokens=a.max_tokens, temperature=a.temperature,
        ignore_eos=a.ignore_eos, slos_ms=parse_goodput(a.goodput), seed=a.seed, api_key=a.api_key,
        timeout_s=a.timeout, json_path=a.json, plots_dir=a.plots, progress=not a.no_progress)


def cmd_bench_serve(a: argparse.Namespace) -> int:
    from tandem.bench.serve import bench_serve

    try:
        cfg = config_from_args(a)
        count, counter_name = token_counter(a.tokenizer)
        data = bench_serve(cfg, count, counter_name)
    except ValueError as e:
        print(f"tandem bench serve: error: {e}", file=sys.stderr)
        return 2
    failed = sum(run["summary"]["failed"] for run in data["runs"])
    completed = sum(run["summary"]["completed"] for run in data["runs"])
    if a.json:
        print(f"results written to {a.json}")
    for p in data.get("plots", []):
        print(f"plot written to {p}")
    return 1 if completed == 0 and failed > 0 else 0


def add_calibrate_parser(ssub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`tandem simulate calibrate`, added to `tandem simulate`'s subcommands."""
    c = ssub.add_parser("calibrate", help="profile this engine (default model, CPU) into a simulator profile")
    c.add_argument("--json", dest="profile_json", default=None, help="profile file to write (default: print)")
    c.add_argument("--quick", action="store_true", help="fewer shapes and repeats (about a minute)")
    c.add_argument("--model", default=None, help="model to profile (default: the default model)")
    c.set_defaults(func=cmd_calibrate)
    return c


def cmd_calibrate(a: argparse.Namespace) -> int:
    from tandem.bench.calibrate import calibrate

    profile = calibrate(model=a.model, quick=a.quick, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    fit = profile["fit"]
    print(f"fit over {len(profile['samples'])} steps: mean error {fit['rel_error_mean']:.1%}, "
          f"max {fit['rel_error_max']:.1%}; coefficients " +
          ", ".join(f"{n}={c:.3g}" for n, c in zip(fit["features"], fit["coef"])))
    if a.profile_json:
        path = Path(a.profile_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(profile, indent=1, default=str))
        print(f"results written to {a.profile_json}")
    else:
        print(json.dumps(profile, indent=1))
    return 0


AGENTS_DESCRIPTION = """Agent sessions with client-side tools, replayed over HTTP (tandem.bench.agents).

    tandem bench agents --url http://127.0.0.1:8000 --rate SESSIONS_PER_S [--trace FILE] [--part report|fit|all]
        [--num-sessions N] [--token-scale F] [--time-scale F] [--person-wait cap:S|cut] [--json PATH]
        [--soak-s SECONDS [--drain-s SECONDS]]

A soak (--soak-s) keeps starting sessions for that long, cycling through the N sessions, scrapes the
server's /metrics as it goes, and reports calls lost, resident memory after the warm-up and whether
the KV the sessions held came back once they ended.
"""


def add_agents_parser(bsub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    g = bsub.add_parser("agents", help="replay real agent sessions (client-side tool loops) over HTTP",
                        description=AGENTS_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_target_args(g)
    g.add_argument("--trace", default="../shared/workloads/agent-sessions/claude-code-opus.jsonl")
    g.add_argument("--part", default="report", choices=("report", "fit", "all"),
                   help="which part of the trace (knobs are fitted on 'fit'; report on 'report')")
    g.add_argument("--num-sessions", type=int, default=8, help="the first N sessions of the part")
    g.add_argument("--max-calls", type=int, default=None, help="cut each session after this many calls")
    g.add_argument("--rate", type=_rate, required=True, help="new sessions per second (Poisson)")
    g.add_argument("--token-scale", type=float, default=0.01, help="scale the trace's token counts")
    g.add_argument("--time-scale", type=float, default=0.05, help="scale the trace's waits")
    g.add_argument("--person-wait", default="cap:60", help="person waits (after end_turn): cap:SECONDS or cut")
    g.add_argument("--context-window", type=int, default=None,
                   help="compact contexts that would not fit this many tokens (default: the trace's, scaled)")
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (what vllm bench serve sends)")
    g.add_argument("--ttft-slo", type=float, default=5.0, help="a session is within the SLO if every call's TTFT is")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--timeout", type=float, default=600.0, help="per-call timeout in seconds")
    g.add_argument("--soak-s", type=float, default=None,
                   help="soak: keep starting sessions for this many seconds, cycling the trace's N sessions")
    g.add_argument("--drain-s", type=float, default=660.0,
                   help="soak: after the last session, wait at most this long for held KV to come back "
                        "(above the server's --session-max-hold-s)")
    g.add_argument("--sample-s", type=float, default=5.0, help="soak: scrape /metrics this often")
    g.add_argument("--label", default="", help="names the run in the results (e.g. the server's policy)")
    g.add_argument("--json", default=None)
    g.add_argument("--plot", default=None, metavar="PNG",
                   help="CDFs of LLM time per session and TTFT per call; with --compare, of several runs")
    g.add_argument("--compare", default=None, metavar="JSON,...",
                   help="earlier runs' --json files (e.g. other server policies) to plot beside this one")
    g.set_defaults(func=cmd_bench_agents)
    return g


def cmd_bench_agents(a: argparse.Namespace) -> int:
    import dataclasses

    from tandem.bench.agents import ReplayOptions, bench_agents
    from tandem.bench.serve import base_url, discover_model
    from tandem.bench.serve_client import Target
    from tandem.workload.agent_sessions import TraceError, load_sessions, parse_person_wait, split

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    try:
        parse_person_wait(a.person_wait)
        if a.num_sessions < 1 or (a.max_calls is not None and a.max_calls < 1):
            raise ValueError("--num-sessions and --max-calls must be >= 1")
        if a.token_scale <= 0 or a.time_scale < 0:
            raise ValueError("--token-scale must be > 0 and --time-scale >= 0")
        if (a.soak_s is not None and a.soak_s <= 0) or a.drain_s < 0 or a.sample_s <= 0:
            raise ValueError("--soak-s and --sample-s must be > 0, --drain-s >= 0")
        sessions = load_sessions(a.trace)
        if a.part != "all":
            sessions = split(sessions)[0 if a.part == "fit" else 1]
        sessions = sessions[:a.num_sessions]
        if a.max_calls is not None:
            sessions = [dataclasses.replace(s, calls=s.calls[:a.max_calls]) for s in sessions]
        others = [json.loads(Path(p).read_text()) for p in a.compare.split(",")] if a.compare else []
        if any(o.get("bench") != "agents" for o in others):
            raise ValueError("--compare takes files `tandem bench agents --json` wrote")
    except (OSError, TraceError, ValueError) as e:
        print(f"tandem bench agents: error: {e}", file=sys.stderr)
        return 2
    url = base_url(a.url)
    target = Target(url, a.model or discover_model(url, a.api_key, log), "chat", a.api_key,
                    temperature=a.temperature, ignore_eos=True)
    opts = ReplayOptions(a.rate, a.token_scale, a.time_scale, a.person_wait, a.context_window, a.seed, a.ttft_slo,
                         a.timeout, a.soak_s, a.sample_s, a.drain_s, extra={"trace": a.trace, "part": a.part, "num_sessions": a.num_sessions,
                                           "max_calls": a.max_calls})
    data = bench_agents(target, sessions, opts, a.json, a.label, log)
    if a.json:
        print(f"results written to {a.json}")
    if a.plot:
        from tandem.bench.plots import plot_agent_runs

        print(f"plot written to {plot_agent_runs(others + [data], a.plot)}")
    if "soak" in data and (data["soak"]["calls_lost"] or not data["soak"].get("drained", True)):
        return 1                                   # a soak that lost a call or kept KV fails
    return 1 if data["summary"]["calls"] and data["summary"]["failed_calls"] == data["summary"]["calls"] else 0
