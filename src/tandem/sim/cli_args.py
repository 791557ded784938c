"""`tandem simulate`: argument setup and commands (kept out of cli.py).

    tandem simulate --scenario faser|augserve|FILE [--json PATH] [--plots DIR] [--seed N] [--requests N]
    tandem simulate --scenario cluster [--replicas 8,16,64] [--rate R | --load F] [--window S] [--requests SESSIONS_PER_REPLICA]
                    [--workloads tools,chat] [--routers tandem,power_of_two,...] [--seed N] [--json PATH]
    tandem simulate --scenario agents [--trace FILE] [--part report|fit|all] [--requests SESSIONS]
                    [--rates R,... | --loads F,...] [--deployment MODEL@HARDWARE] [--policies vllm-lru,infercept,tandem]
                    [--person-wait cap:S|cut] [--context-window N] [--json PATH]
    tandem simulate calibrate [--json PATH] [--quick]       profile this engine on this machine
    tandem simulate speed [--requests N] [--rate R]           the simulator's own speed (events/s)
    tandem predictor train [--requests N] [--seed S] [--eval-seed E] --json PATH
                                                              AugServe's Stage I predictor, trained offline
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

DESCRIPTION = __doc__


def add_simulate_parser(sub: argparse._SubParsersAction,
                        subcommands: Sequence[Callable[[argparse._SubParsersAction], object]] = ()
                        ) -> argparse.ArgumentParser:
    """`subcommands` add the subcommands that live outside the simulator (`calibrate` measures the
    real engine: tandem.bench.cli_args.add_calibrate_parser), listed before `speed`."""
    s = sub.add_parser("simulate", help="discrete-event simulator on the real scheduler (paper scale)",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("--scenario", default=None, help="faser | augserve | cluster | agents | a scenario JSON file")
    s.add_argument("--json", default=None, help="write the results here")
    s.add_argument("--plots", default=None, help="write PNG plots into this directory")
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--requests", type=int, default=None, help="requests per run (scenario default otherwise)")
    s.add_argument("--hardware", default=None, help="faser: accelerator preset (default H100-80GB), or calibrated:PATH "
                                                          "for a `tandem simulate calibrate` profile of this machine")
    s.add_argument("--gpus", type=int, default=None, help="faser: GPUs for the 32B target (default 2)")
    s.add_argument("--peak-load", type=float, default=None,
                   help="faser: diurnal peak / no-SD capacity (default 1)")
    s.add_argument("--acceptance", default=None, metavar="PATH",
                   help="faser: measured kinds from `tandem bench acceptance --json PATH` (lengths, acceptance, "
                        "offers; default: assumed kinds)")
    s.add_argument("--no-ablation", action="store_true",
                   help="faser: skip the frontiers / overlap ablation runs")
    s.add_argument("--deployments", default=None,
                   help="augserve: MODEL@HARDWARE,... (default: llama3-8b and llama2-13b on A100-80GB "
                        "and H100-80GB)")
    s.add_argument("--policies", default=None, help="augserve, agents: scheduling policies to compare")
    s.add_argument("--step-jitter", default=None, metavar="P:X",
                   help="augserve: each step takes X times as long with probability P (default: none)")
    s.add_argument("--predictor", default=None, metavar="PATH",
                   help="augserve: Stage I predictor state (`tandem predictor train`; default: train on seed + 1)")
    s.add_argument("--replicas", default=None, help="cluster: replica counts, e.g. 8,16,64")
    s.add_argument("--rate", type=float, default=None,
                   help="cluster: new sessions/s PER REPLICA (default: --load x one replica's probed capacity)")
    s.add_argument("--load", type=float, default=None, help="cluster: fraction of one replica's capacity (default 0.8)")
    s.add_argument("--window", type=float, default=None, help="cluster: session arrival window in s (default 40)")
    s.add_argument("--workloads", default=None, help="cluster: tools,chat")
    s.add_argument("--routers", default=None, help="cluster: tandem,round_robin,power_of_two,prefix")
    s.add_argument("--deployment", default=None, help="cluster: MODEL@HARDWARE (default llama2-13b@A100-80GB); "
                                                      "agents: (default llama3-8b@H100-80GB)")
    s.add_argument("--trace", default=None, help="agents: session trace (JSON lines; default the Claude Code sessions)")
    s.add_argument("--part", default=None, help="agents: report | fit | all of the trace (default report)")
    s.add_argument("--rates", default=None, help="agents: session rates, e.g. 0.01,0.02 (default: --loads)")
    s.add_argument("--loads", default=None,
                   help="agents: multiples of vllm-lru's capacity (default 0.25,0.5,1,1.5,2)")
    s.add_argument("--person-wait", default=None, help="agents: cap:SECONDS or cut (default cap:60)")
    s.add_argument("--context-window", type=int, default=None, help="agents: model window in tokens (default 131072)")
    s.add_argument("--swap-space-gb", type=float, default=None, help="agents: host memory for KV (default 256)")
    s.add_argument("--max-calls", type=int, default=None, help="agents: cut each session after this many calls")
    s.set_defaults(func=cmd_simulate)
    ssub = s.add_subparsers(dest="sim_command")
    for add in subcommands:
        add(ssub)
    p = ssub.add_parser("speed", help="simulate N augmented-mixture requests and report events/s")
    p.add_argument("--requests", dest="speed_requests", type=int, default=10000)
    p.add_argument("--rate", type=float, default=20.0, help="Poisson rate (req/s)")
    p.add_argument("--policy", default="fcfs-discard")
    p.add_argument("--hardware", dest="speed_hardware", default="H100-80GB")
    p.add_argument("--model", dest="speed_model", default="llama3-8b")
    p.set_defaults(func=cmd_speed)
    return s


def _jitter(text: str) -> tuple[float, float]:
    """--step-jitter P:X -> (P, X), checked."""
    try:
        p, x = (float(v) for v in text.split(":"))
    except ValueError:
        raise ValueError(f"--step-jitter wants P:X (e.g. 0.05:5), got {text!r}") from None
    if not (0.0 <= p <= 1.0 and x > 0):
        raise ValueError(f"--step-jitter needs 0 <= P <= 1 and X > 0, got {text!r}")
    return p, x


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _write(path: str | None, data: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=1, default=str))
        print(f"results written to {path}")


def _run_scenario(a: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from tandem.sim import report

    name = a.scenario
    if name == "faser":
        from tandem.sim.scenarios.faser import FaserOptions, run_faser

        opts = FaserOptions()
        for attr, value in (("num_requests", a.requests), ("seed", a.seed), ("hardware", a.hardware),
                            ("num_gpus", a.gpus), ("peak_load", a.peak_load), ("acceptance", a.acceptance)):
            if value is not None:
                setattr(opts, attr, value)
        opts.ablation = not a.no_ablation
        res = run_faser(opts, _log)
        return res, report.faser_tables(res)
    if name == "augserve":
        from tandem.sim.scenarios.augserve import AugServeOptions, run_augserve

        opts = AugServeOptions()
        if a.requests is not None:
            opts.num_requests = opts.probe_requests = a.requests
        if a.seed is not None:
            opts.seed = a.seed
        if a.deployments:
            opts.deployments = tuple(tuple(d.split("@")) for d in a.deployments.split(","))
        if a.policies:
            opts.policies = tuple(a.policies.split(","))
        if a.step_jitter:
            opts.step_jitter = _jitter(a.step_jitter)
        if a.predictor:
            from tandem.sim.predictor import check

            try:
                opts.predictor = json.loads(Path(a.predictor).read_text())
            except OSError as e:
                raise ValueError(f"cannot read the predictor {a.predictor}: {e.strerror}") from e
            check(opts.predictor)
        res = run_augserve(opts, _log)
        return res, report.augserve_tables(res)
    if name == "cluster":
        from tandem.sim.scenarios.cluster import ClusterOptions, cluster_tables, run_cluster

        opts = ClusterOptions()
        for attr, value in (("sessions_per_replica", a.requests), ("seed", a.seed), ("rate", a.rate),
                            ("load", a.load), ("window_s", a.window)):
            if value is not None:
                setattr(opts, attr, value)
        if a.replicas:
            opts.replicas = tuple(int(x) for x in a.replicas.split(","))
        if a.workloads:
            opts.workloads = tuple(a.workloads.split(","))
        if a.routers:
            opts.policies = tuple(a.routers.split(","))
        if a.deployment:
            opts.model, _, opts.hardware = a.deployment.partition("@")
        res = run_cluster(opts, _log)
        return res, cluster_tables(res)
    if name == "agents":
        return _run_agents(a)
    from tandem.sim.scenarios.file import run_file

    if not Path(name).is_file():
        raise ValueError(f"unknown scenario {name!r}: faser, augserve, cluster, agents, or a scenario JSON file")
    res = run_file(name, _log, a.seed, a.requests)
    return res, report.file_tables(res)


def _floats(text: str, flag: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"{flag} wants numbers separated by commas, got {text!r}") from None
    if not values or min(values) <= 0:
        raise ValueError(f"{flag} wants positive numbers, got {text!r}")
    return values


def _run_agents(a: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from tandem.sim.scenarios.agents import AgentOptions, agents_tables, run_agents
    from tandem.workload.agent_sessions import TraceError, parse_person_wait

    opts = AgentOptions()
    for attr, value in (("trace", a.trace), ("part", a.part), ("num_sessions", a.requests), ("seed", a.seed),
                        ("person_wait", a.person_wait), ("window", a.context_window),
                        ("swap_space_gb", a.swap_space_gb), ("max_calls", a.max_calls)):
        if value is not None:
            setattr(opts, attr, value)
    parse_person_wait(opts.person_wait)
    if opts.num_sessions < 1 or (opts.max_calls is not None and opts.max_calls < 1):
        raise ValueError("--requests (sessions) and --max-calls must be >= 1")
    if a.rates:
        opts.rates = _floats(a.rates, "--rates")
    if a.loads:
        opts.loads = _floats(a.loads, "--loads")
    if a.policies:
        opts.policies = tuple(a.policies.split(","))
    if a.deployment:
        opts.model, _, opts.hardware = a.deployment.partition("@")
    if not Path(opts.trace).is_file():
        raise ValueError(f"no session trace at {opts.trace} (give --trace FILE)")
    try:
        res = run_agents(opts, _log)
    except TraceError as e:
        raise ValueError(str(e)) from None
    return res, agents_tables(res)


def cmd_simulate(a: argparse.Namespace) -> int:
    if not a.scenario:
        print("tandem simulate: error: give --scenario faser|augserve|FILE "
              "(or a subcommand: calibrate, speed)", file=sys.stderr)
        return 2
    try:
        res, text = _run_scenario(a)
    except ValueError as e:
        print(f"tandem simulate: error: {e}", file=sys.stderr)
        return 2
    print(text)
    _write(a.json, res)
    if a.plots:
        from tandem.sim.plots import plot_results

        for p in plot_results(res, a.plots):
            print(f"plot written to {p}")
    return 0


def add_predictor_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("predictor", help="AugServe's Stage I predictor (output lengths, tool statistics)")
    psub = p.add_subparsers(dest="predictor_cmd", required=True)
    t = psub.add_parser("train", help="train on a held-out trace of the simulator's augmented mixture")
    t.add_argument("--requests", type=int, default=3000, help="requests in the training trace")
    t.add_argument("--seed", type=int, default=1, help="the training trace's seed (keep it off the runs' seeds)")
    t.add_argument("--eval-seed", type=int, default=0, help="report Kendall tau on this seed's trace")
    t.add_argument("--dataset", default="augmented", help="augmented[:TYPE] or a trace file")
    t.add_argument("--json", required=True, help="write the predictor state here")
    t.set_defaults(func=cmd_predictor_train)
    return p


def cmd_predictor_train(a: argparse.Namespace) -> int:
    from tandem.sim.predictor import evaluate, train
    from tandem.sim.workload import WorkloadSpec

    if a.seed == a.eval_seed:
        print("tandem predictor train: error: --seed and --eval-seed must differ (held-out evaluation)",
              file=sys.stderr)
        return 2
    if a.requests < 1:
        print("tandem predictor train: error: --requests must be >= 1", file=sys.stderr)
        return 2
    try:
        state = train(WorkloadSpec(dataset=a.dataset, num_requests=a.requests), a.seed)
        state["evaluation"] = evaluate(state, WorkloadSpec(dataset=a.dataset, num_requests=a.requests), a.eval_seed)
    except ValueError as e:
        print(f"tandem predictor train: error: {e}", file=sys.stderr)
        return 2
    ev = state["evaluation"]
    tau = "undefined" if ev["kendall_tau"] is None else f"{ev['kendall_tau']:.3f}"
    print(f"trained on {state['trained_on']}; Kendall tau {tau} on seed {ev['seed']} ({ev['num_requests']} requests)")
    _write(a.json, state)
    return 0


def cmd_speed(a: argparse.Namespace) -> int:
    from tandem.sim.speed import measure_speed

    res = measure_speed(a.speed_requests, a.rate, a.policy, a.speed_hardware, a.speed_model)
    s = res["sim"]
    tokens = res["summary"]["total_output_tokens"]
    print(f"{a.speed_requests} augmented-mixture requests ({a.policy}, {a.speed_model} on "
          f"{a.speed_hardware}, {a.rate} req/s): {s['wall_s']:.1f} s wall, {s['events']} events, "
          f"{s['events_per_s']:,.0f} events/s, {res['counters']['steps']} steps, {tokens} output tokens "
          f"({tokens / s['wall_s']:,.0f} per wall second), "
          f"{res['counters']['virtual_end_s']:.0f} s simulated")
    return 0
