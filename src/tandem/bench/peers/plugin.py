"""vLLM with Tandem's scheduler (`--scheduler-cls tandem.integrations.vllm.TandemScheduler`) against
vLLM with its own, on this machine, one server after the other, judged by the same load generators:
`tandem bench compare --peer vllm --parts plugin-agents,plugin-serve`.

    tandem bench compare --peer vllm --parts plugin-agents,plugin-serve [--agent-repeats 3]
        [--rates 1,2,4] [--seeds 0,1,2] [--plugin-options JSON] [--out DIR]

- The environment: vLLM 0.32's CPU build (the comparison's peer), given this Tandem on PYTHONPATH;
  the default model (Tandem's converted HF directory) or --model.
- plugin-agents: real Claude Code sessions replayed over HTTP by `tandem bench agents` (client-side
  tool loops, each call a chat completion with the session's context and `X-Session-ID`, which vLLM
  reads as the request's session), with a KV cache small enough that memory binds, as in
  docs/benchmarks.md's agents table; --agent-repeats runs per system, alternating. Reports LLM time
  per session (mean, p50, p99), TTFT and sessions/h within the SLO.
- plugin-serve: `vllm bench serve` (ShareGPT, chat endpoint, streaming, temperature 1) at each rate
  and seed, goodput at TTFT <= --ttft-ms and TPOT <= --tpot-ms (peers.vllm.serve_rounds), and
  again at --slo-scale times that SLO.
Both servers get the same flags; the plugin's server adds --scheduler-cls and
--additional-config '{"tandem": PLUGIN_OPTIONS}'. Writes OUT/plugin.json, OUT/plugin.md and the raw
runs under OUT/raw/.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import tandem
from tandem.bench.peers.vllm import Server, log, serve_rounds, vllm_env, vllm_serve_cmd, warm_up

TANDEM_SRC = Path(tandem.__file__).resolve().parents[1]     # what the plugin's vLLM imports Tandem from
PLUGIN = "tandem.integrations.vllm.TandemScheduler"
# docs/benchmarks.md's agents setting: 2,304 tokens of KV, contexts compacted to 1,800. In float32:
# vLLM 0.32's CPU build segfaults in reshape_and_cache with a float16 KV cache under a float32
# model (its own scheduler too, within two rounds of four concurrent requests).
AGENT_SERVER = ["--kv-cache-memory-bytes", "107374182"]
AGENT_BENCH = ["--rate", "0.5", "--num-sessions", "8", "--max-calls", "12", "--token-scale", "0.01",
               "--time-scale", "0.05", "--context-window", "1800"]


def server(a, peer: Path, model_dir: Path, dtype: str, name: str, port: int,
           extra: list[str]) -> tuple[list[str], int, dict]:
    cmd = vllm_serve_cmd(peer, model_dir, dtype, port, a.vllm_memory_fraction, a.load_format) + extra
    env = vllm_env(a, peer)
    if name == "vllm-tandem":
        cmd += ["--scheduler-cls", PLUGIN, "--additional-config", json.dumps({"tandem": json.loads(a.plugin_options)})]
        env["PYTHONPATH"] = str(TANDEM_SRC)
    return cmd, port, env


def run_agents(a, peer: Path, model_dir: Path, dtype: str, raw: Path) -> dict[str, list[dict]]:
    systems = a.plugin_systems.split(",")
    out: dict[str, list[dict]] = {s: [] for s in systems}
    for rep in range(a.agent_repeats):
        for name in systems:
            cmd, port, env = server(a, peer, model_dir, dtype, name, 18200, AGENT_SERVER)
            log(f"agents: starting {name} (repeat {rep})")
            srv = Server(name, cmd, port, raw / f"agents-server-{name}-r{rep}.log", env=env)
            try:
                warm_up(port, model_dir.name, a.warmup_requests)
                path = raw / f"agents-{name}-r{rep}.json"
                subprocess.run([sys.executable, "-m", "tandem", "bench", "agents", "--url", f"http://127.0.0.1:{port}", *AGENT_BENCH,
                                "--trace", a.trace, "--seed", str(rep), "--label", name, "--json", str(path)], check=True,
                               stdout=subprocess.DEVNULL)
                summary = json.loads(path.read_text())["summary"]
                out[name].append(summary)
                log(f"  {name}: LLM time per session mean {summary['llm_time_per_session_s']['mean']:.1f} s, "
                    f"TTFT p50 {summary['ttft_s']['p50']:.2f} s, failed {summary['failed_calls']}")
            finally:
                srv.stop()
    return out


SYSTEMS = ("vllm", "vllm-tandem")


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def goodput_at(raw: Path, name: str, rate: str, seed: int, ttft_s: float, tpot_s: float) -> float | None:
    """Goodput of one `vllm bench serve` run at another SLO, from its per-request TTFTs and latencies
    (TPOT as vLLM computes it: the time after the first token over the tokens after it)."""
    path = raw / f"serve-{name}-rate{float(rate):g}-seed{seed}.json"
    if not path.exists():
        return None
    d = json.loads(path.read_text())
    good = 0
    for ttft, lat, n in zip(d["ttfts"], d["latencies"], d["output_lens"]):
        tpot = (lat - ttft) / (n - 1) if n > 1 else 0.0
        good += ttft <= ttft_s and tpot <= tpot_s
    return good / d["duration"]


def report(data: dict, raw: Path | None = None) -> str:
    lines = [f"vLLM {data['peer_version']}, {data['machine'].get('cpu', '?')}, dtype {data['dtype']}; "
             f"plugin options {data.get('plugin_options', data.get('tandem_options'))}", ""]
    if "agents" in data:
        ag = data["agents"]
        lines += ["| agents, median of runs | LLM time per session mean / p50 / p99 s | TTFT p50 / p99 s | "
                  "sessions/h within SLO | runs (mean per run) |", "|---|---:|---:|---:|---|"]
        for name in SYSTEMS:
            runs = ag.get(name, [])
            if not runs:
                continue
            llm = {k: median([r["llm_time_per_session_s"][k] for r in runs]) for k in ("mean", "p50", "p99")}
            ttft = {k: median([r["ttft_s"][k] for r in runs]) for k in ("p50", "p99")}
            per_run = ", ".join(f"{r['llm_time_per_session_s']['mean']:.1f}" for r in runs)
            lines.append(f"| {name} | {llm['mean']:.1f} / {llm['p50']:.1f} / {llm['p99']:.1f} | "
                         f"{ttft['p50']:.2f} / {ttft['p99']:.2f} | "
                         f"{median([r['sessions_per_hour_within_slo'] for r in runs]):.0f} | {per_run} |")
        if all(ag.get(s) for s in SYSTEMS):
            base = median([r["llm_time_per_session_s"]["mean"] for r in ag["vllm"]])
            mine = median([r["llm_time_per_session_s"]["mean"] for r in ag["vllm-tandem"]])
            lines += ["", f"Mean LLM time per session, vLLM's scheduler / Tandem's: **{base / mine:.2f}x**", ""]
    if "sharegpt" in data:
        sg = data["sharegpt"]
        lines += ["| ShareGPT rate req/s | goodput vLLM | goodput vLLM + Tandem | ratio | TTFT p50 ms vLLM / "
                  "+ Tandem | TPOT p50 ms vLLM / + Tandem |", "|---:|---:|---:|---:|---:|---:|"]
        for rate in sg["vllm"]:
            g = {s: median([r["request_goodput"] for r in sg[s][rate]]) for s in SYSTEMS}
            t = {s: median([r["median_ttft_ms"] for r in sg[s][rate]]) for s in SYSTEMS}
            p = {s: median([r["median_tpot_ms"] for r in sg[s][rate]]) for s in SYSTEMS}
            ratio = g["vllm-tandem"] / g["vllm"] if g["vllm"] else float("nan")
            lines.append(f"| {rate} | {g['vllm']:.3f} | {g['vllm-tandem']:.3f} | {ratio:.3f} | "
                         f"{t['vllm']:.0f} / {t['vllm-tandem']:.0f} | {p['vllm']:.0f} / {p['vllm-tandem']:.0f} |")
        scale = data.get("slo_scale")
        if raw is not None and scale:
            ttft_s, tpot_s = data["ttft_ms"] * scale / 1000, data["tpot_ms"] * scale / 1000
            lines += ["", f"Goodput at {scale:g}x the SLO (TTFT <= {ttft_s:g} s, TPOT <= {tpot_s * 1000:g} ms), "
                      "median of seeds (per seed):", "",
                      "| rate | vLLM | vLLM + Tandem | ratio | output tok/s vLLM / + Tandem |", "|---:|---:|---:|---:|---:|"]
            for rate in sg["vllm"]:
                per = {s: [goodput_at(raw, s, rate, seed, ttft_s, tpot_s) for seed in data["seeds"]] for s in SYSTEMS}
                if any(x is None for xs in per.values() for x in xs):
                    continue
                g = {s: median(per[s]) for s in SYSTEMS}
                tok = {s: median([r["output_throughput"] for r in sg[s][rate]]) for s in SYSTEMS}
                seeds = "; ".join(f"{a:.3f} / {b:.3f}" for a, b in zip(per["vllm"], per["vllm-tandem"]))
                ratio = g["vllm-tandem"] / g["vllm"] if g["vllm"] else float("nan")
                lines.append(f"| {rate} | {g['vllm']:.3f} | {g['vllm-tandem']:.3f} | {ratio:.3f} ({seeds}) | "
                             f"{tok['vllm']:.1f} / {tok['vllm-tandem']:.1f} |")
    return "\n".join(lines) + "\n"


def run_plugin(a, peer: Path, model_dir: Path, dtype: str, version: str, out: Path) -> dict:
    """The plugin parts named in a.parts. Writes OUT/plugin.json (after each part) and OUT/plugin.md."""
    from tandem.bench.common import machine_info

    raw = out / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    data = {"machine": machine_info(), "peer_version": version, "dtype": dtype, "plugin_options": a.plugin_options,
            "ttft_ms": a.ttft_ms, "tpot_ms": a.tpot_ms, "slo_scale": a.slo_scale, "seeds": a.seeds}
    parts = a.parts.split(",")
    if "plugin-agents" in parts:
        data["agents"] = run_agents(a, peer, model_dir, dtype, raw)
        (out / "plugin.json").write_text(json.dumps(data, indent=1))
    if "plugin-serve" in parts:
        servers = {name: server(a, peer, model_dir, dtype, name, 18300, []) for name in SYSTEMS}
        data["sharegpt"] = serve_rounds(a, peer, model_dir, servers, raw)
        (out / "plugin.json").write_text(json.dumps(data, indent=1))
    text = report(data, raw)
    (out / "plugin.md").write_text(text)
    print(text)
    return data
