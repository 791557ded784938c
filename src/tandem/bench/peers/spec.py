"""Speculative decoding, Tandem against vLLM's CPU build on this machine, judged by `vllm bench serve`:
`tandem bench compare --peer vllm --parts spec`.

    tandem bench compare --peer vllm --parts spec [--workloads sharegpt,humaneval-edit,humaneval-tools]
        [--concurrency 1,8] [--temperatures 1,0]
        [--spec-systems vllm-none,vllm-ngram2,vllm-ngram5,tandem-none,tandem-ngram,tandem-suffix] [--out DIR]

- Workloads (tandem.workload.datasets): ShareGPT (speculation pays little), `humaneval-edit` (real
  functions rewritten with comments and type hints: outputs copy the input), `humaneval-tools`
  (an agent's multi-turn transcript of JSON tool calls: outputs repeat earlier outputs). Each is
  written as vLLM's custom JSONL: the prompt with the model's chat template already applied
  (`--skip-chat-template`, /v1/completions, so multi-turn transcripts stay multi-turn) and its
  expected output length; requests end at EOS or there.
- Closed loop: `--request-rate inf --max-concurrency C`, at each of `--temperatures` (1: what
  `vllm bench serve` users send; 0: greedy, as code agents often run); each (concurrency,
  temperature) draws its own prompts (the same for every system), so no run is served from an
  earlier run's prefix cache.
- Systems: `vllm-none`, `vllm-ngramK` (vLLM's prompt lookup, K drafts, n-grams 2-4),
  `vllm-ngram-table` (the same with vLLM's per-batch-size draft lengths), `vllm-suffix`
  (only where arctic-inference is installed in the peer), `tandem-none`, `tandem-ngram`,
  `tandem-suffix` (Tandem's adaptive per-request lengths over each proposer). Every server gets
  --warmup-requests unmeasured requests first.
Writes OUT/spec.json (every run's metrics) and OUT/spec.md (output tok/s per system, and Tandem's
suffix speculation against the best vLLM configuration and against Tandem without speculation);
--add runs more systems into an existing OUT/spec.json's table on the same prompt files.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tandem.bench.peers.vllm import Server, log, tandem_serve_cmd, vllm_env, vllm_serve_cmd, warm_up

METRICS = ("output_throughput", "request_throughput", "median_ttft_ms", "median_tpot_ms", "completed",
           "total_output_tokens")


def vllm_spec(name: str) -> dict | None:
    if name == "vllm-none":
        return None
    if name == "vllm-suffix":
        return {"method": "suffix"}
    if name == "vllm-ngram-table":        # vLLM's dynamic SD: 5 drafts alone, 3 up to 4 requests, then 1
        return {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4,
                "num_speculative_tokens_per_batch_size": [[1, 1, 5], [2, 4, 3], [5, 256, 1]]}
    k = int(name.removeprefix("vllm-ngram"))
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def server_cmd(a, peer: Path, model_dir: Path, dtype: str, name: str) -> tuple[list[str], int, dict | None]:
    if name.startswith("vllm"):
        cmd = vllm_serve_cmd(peer, model_dir, dtype, 18000, a.vllm_memory_fraction, a.load_format)
        spec = vllm_spec(name)
        if spec is not None:
            cmd += ["--speculative-config", json.dumps(spec)]
        return cmd, 18000, vllm_env(a, peer)
    cmd = tandem_serve_cmd(model_dir, 18001, a.load_format)
    method = name.removeprefix("tandem-")
    if method != "none":
        cmd += ["--speculative", method]
    return cmd + a.tandem_args.split(), 18001, None


def bench_deps(peer: Path) -> None:
    """vLLM's custom dataset reads JSONL with pandas (its `bench` extra), which the CPU build lacks."""
    if subprocess.run([str(peer / "bin" / "python"), "-c", "import pandas"], capture_output=True).returncode:
        subprocess.run([str(peer / "bin" / "python"), "-m", "pip", "install", "-q", "pandas"], check=True)


def write_workload(name: str, n: int, seed: int, model_dir: Path, path: Path) -> None:
    from transformers import AutoTokenizer

    from tandem.workload.datasets import load_dataset

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    items = load_dataset(name, n, seed=seed, count_tokens=lambda s: len(tok.encode(s)))
    with path.open("w") as f:
        for it in items:
            prompt = tok.apply_chat_template(it.messages, add_generation_prompt=True, tokenize=False)
            f.write(json.dumps({"prompt": prompt, "output_tokens": it.max_tokens}) + "\n")


def bench(peer: Path, model_dir: Path, port: int, dataset: Path, n: int, conc: int, temperature: float,
          out: Path) -> dict:
    cmd = [str(peer / "bin" / "vllm"), "bench", "serve", "--backend", "openai", "--endpoint", "/v1/completions",
           "--base-url", f"http://127.0.0.1:{port}", "--model", model_dir.name, "--tokenizer", str(model_dir),
           "--dataset-name", "custom", "--dataset-path", str(dataset), "--skip-chat-template",
           "--num-prompts", str(n), "--request-rate", "inf", "--max-concurrency", str(conc),
           "--temperature", str(temperature), "--seed", "0", "--percentile-metrics", "ttft,tpot,e2el",
           "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"vllm bench serve failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    data = json.loads(out.read_text())
    for bulky in ("generated_texts", "itls", "errors", "ttfts", "input_lens", "output_lens"):
        data.pop(bulky, None)
    out.write_text(json.dumps(data))
    return {k: data.get(k) for k in METRICS}


def report(data: dict) -> str:
    systems = data["systems"]
    lines = [f"Machine: {data['machine']}; vLLM {data['peer_version']}; dtype {data['dtype']}; "
             "output tok/s per run (closed loop).", ""]
    head = "| workload | temperature | concurrency | " + " | ".join(systems) + " | best vLLM | tandem-suffix / best vLLM | " \
           "tandem-suffix / tandem-none |"
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for w, t, c in ((w, t, c) for w in data["workloads"] for t in data["temperatures"] for c in data["concurrency"]):
        row = {s: data["runs"].get(s, {}).get(w, {}).get(f"{t:g}", {}).get(str(c), {}).get("output_throughput")
               for s in systems}
        vl = {s: v for s, v in row.items() if s.startswith("vllm") and v}
        best = max(vl, key=vl.get) if vl else None
        cells = [f"{row[s]:.1f}" if row[s] else "-" for s in systems]
        ts, tn = row.get("tandem-suffix"), row.get("tandem-none")
        r1 = f"{ts / vl[best]:.2f}x" if ts and best else "-"
        r2 = f"{ts / tn:.2f}x" if ts and tn else "-"
        lines.append(f"| {w} | {t:g} | {c} | " + " | ".join(cells) + f" | {best or '-'} | {r1} | {r2} |")
    return "\n".join(lines) + "\n"


def run_spec(a, peer: Path, model_dir: Path, dtype: str, version: str, out: Path) -> dict:
    """The spec part, `a` its options: every system served in turn and driven over every workload,
    temperature and concurrency. Writes OUT/spec.json (after every run) and OUT/spec.md."""
    from tandem.bench.common import machine_info

    raw = out / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    bench_deps(peer)
    concs, temps = a.concurrency, a.temperatures
    workloads, systems = a.workloads.split(","), a.spec_systems.split(",")
    data = {"machine": machine_info(), "peer_version": version, "dtype": dtype, "model": str(model_dir),
            "temperatures": temps, "workloads": workloads, "concurrency": concs, "systems": systems,
            "tandem_args": a.tandem_args, "runs": {}}
    if a.add:           # more systems into the existing run's table (its workloads: peers.cli checked them)
        old = json.loads((out / "spec.json").read_text())
        data["runs"] = old["runs"]
        data["systems"] = old["systems"] + [s for s in systems if s not in old["systems"]]
    files = {}
    for w in workloads:
        for i, (t, c) in enumerate((t, c) for t in temps for c in concs):
            n = max(a.min_prompts, a.prompts_per_stream * c)
            files[w, t, c] = (raw / f"{w}-t{t:g}-c{c}.jsonl", n)
            if not (a.add and files[w, t, c][0].exists()):
                write_workload(w, n, 100 + i, model_dir, files[w, t, c][0])
    for s in systems:
        cmd, port, env = server_cmd(a, peer, model_dir, dtype, s)
        log(f"starting {s}: {' '.join(cmd)}")
        try:
            server = Server(s, cmd, port, raw / f"server-{s}.log", env=env)
        except RuntimeError as e:
            log(f"  {s} did not start: {e}")
            data["runs"][s] = {"error": str(e)}
            continue
        try:
            warm_up(port, model_dir.name, a.warmup_requests)
            for w, t, c in ((w, t, c) for w in workloads for t in temps for c in concs):
                path, n = files[w, t, c]
                res = bench(peer, model_dir, port, path, n, c, t, raw / f"{s}-{w}-t{t:g}-c{c}.json")
                data["runs"].setdefault(s, {}).setdefault(w, {}).setdefault(f"{t:g}", {})[str(c)] = res
                log(f"  {s} {w} T={t:g} c={c}: {res['output_throughput']:.1f} tok/s, {res['completed']} done, "
                    f"TPOT p50 {res['median_tpot_ms']:.0f} ms")
                (out / "spec.json").write_text(json.dumps(data, indent=1))
        finally:
            server.stop()
    (out / "spec.json").write_text(json.dumps(data, indent=1))
    (out / "spec.md").write_text(report(data))
    print(report(data))
    return data
