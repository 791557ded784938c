"""Tandem against llama.cpp on the same GGUF: its server (`llama-server`) judged by `vllm bench serve`,
and one stream against its own benchmark (`llama-bench`).

    tandem bench compare --peer llamacpp --llama-server PATH [--rates 2,4] [--seeds 0,1,2] [--model F.gguf]
                         [--num-prompts 64] [--slots 16] [--max-concurrency N] [--out DIR]
                         [--engines llamacpp,tandem] [--json PATH]
    tandem bench compare --peer llamacpp --parts one-stream --llama-bench PATH
                         [--model default,1b=1b.gguf,...] [--rounds 3] [--max-tokens 128]

A user serving a GGUF on a CPU is as likely to pick llama.cpp as vLLM, so this is `--peer vllm`'s
served part with llama.cpp in vLLM's place: the same ShareGPT prompts per (rate, seed)
(`peers.vllm.serve_rounds`, `vllm bench serve` from the vLLM peer's environment), the chat endpoint, streaming, goodput at TTFT <= --ttft-ms and
TPOT <= --tpot-ms, medians over seeds.

- llama.cpp: `llama-server` built from source on this machine (`-DGGML_NATIVE=ON`, see
  docs/benchmarks.md for the commands), on --model's one GGUF: by default the default model's (the
  Q4_1 file Tandem's default model is converted from and whose blocks Tandem computes on), or a
  shape's file from `tandem model dummy` (its tokenizer is the default model's), all cores (`-t`), `--slots`
  parallel sequences with continuous batching (llama.cpp's default) and 2,048 tokens of context
  each (Tandem's and vLLM's `max_model_len` here), the GGUF's chat template (`--jinja`). Its other
  defaults stay, except sampling: a request that names no sampling parameter gets temperature 1
  and no top-k / top-p / min-p truncation, what vLLM and Tandem do with this model, instead of
  llama.cpp's own defaults (0.8, 40, 0.95, 0.05), so that all engines sample the same distribution.
- Tandem: `tandem serve` on the same file (the default model: the directory converted from it) with
  default flags (plus --tandem-args).
- `--max-concurrency N --rates inf`: a closed loop of N streams (`vllm bench serve`'s flags).

One stream (`--parts one-stream`), per GGUF file of --model (`default`: the default model's own
file; `tandem model dummy` writes the shapes): in each of --rounds rounds, both engines back to
back on each file (a VM's memory bandwidth drifts within minutes, so a round pairs them):
- Tandem: `tandem bench offline --concurrency 1 --repeats 3` on the file, its figure the median
  decode-only step of the 3 runs (prefill excluded), and its engine's peak resident memory;
- llama.cpp: `llama-bench -p 0 -n N -r 3 -t CORES` (generation only, its mean tokens/s).
The table: medians over rounds of decode tokens/s, their ratio per round, and the peak RSS against
the file plus the 1 GiB KV cache Tandem is given.

Writes OUT/compare.json (per run figures and medians), OUT/compare.md and the raw runs under OUT/raw/
(default OUT: docs/results/compare_llamacpp/latest in the source checkout). `compare(a)` is the command; the
options are in tandem.bench.peers.cli (add_compare_parser).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
from pathlib import Path

from tandem.bench.peers import tandem_bin
from tandem.bench.peers.report import SERVE_METRICS, serve_medians, serve_row
from tandem.bench.peers.vllm import log, peer_dir, serve_rounds

ENGINES = ("llamacpp", "tandem")
PARTS = ("serve", "one-stream")
ONE_STREAM_KV_GB = 1.0


def llama_version(binary: Path) -> str:
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True)
    return " ".join((out.stdout + out.stderr).split())[:200]


def markdown(data: dict) -> str:
    concurrency = f", at most {data['max_concurrency']} in flight" if data.get("max_concurrency") else ""
    lines = [f"Tandem vs llama.cpp's llama-server ({data['llama_version']}), same machine, one after the "
             f"other ({data['machine']}); medians over seeds {data['seeds']}; ratio = Tandem / llama.cpp "
             f"(for latencies below 1 is better).", "",
             f"`vllm bench serve`, {data.get('model', 'the default model')}, ShareGPT, {data['num_prompts']} prompts"
             f"{concurrency}, chat endpoint, llama-server --parallel {data.get('slots', 16)}; goodput: TTFT <= "
             f"{data['ttft_ms']} ms and TPOT <= {data['tpot_ms']} ms:", "",
             "| rate | metric | llama.cpp | Tandem | Tandem / llama.cpp |", "|---:|---|---:|---:|---:|"]
    for rate, per in data["medians"].items():
        for key, label, _ in SERVE_METRICS:
            lines.append(serve_row(float(rate), label, per.get("llamacpp", {}).get(key), per.get("tandem", {}).get(key)))
    failed = {name: {rate: [r.get("failed") or 0 for r in runs] for rate, runs in per.items()}
              for name, per in data.get("runs", {}).items()}
    if any(n for per in failed.values() for counts in per.values() for n in counts):
        lines += ["", "Failed requests per seed (`vllm bench serve` counts their tokens nowhere; the raw runs' "
                      "`errors` say why): " + "; ".join(f"{name} at rate {rate}: {counts}" for name, per in failed.items()
                                                       for rate, counts in per.items())]
    return "\n".join(lines) + "\n"


def compare(a) -> dict:
    """The comparison `tandem bench compare --peer llamacpp` runs, `a` its options (rates and seeds
    as lists, parts and engines comma-separated subsets of PARTS and ENGINES). Writes
    OUT/compare.json and OUT/compare.md, prints the tables, returns what compare.json holds."""
    from tandem.bench.common import machine_info

    out = Path(a.out)
    raw = out / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    parts = a.parts.split(",")
    data: dict = {"machine": machine_info(), "parts": parts}
    log(f"machine {data['machine']}")
    tables = []
    if "serve" in parts:
        data["serve"] = serve(a, raw)
        tables.append(markdown({**data["serve"], "machine": data["machine"]}))
    if "one-stream" in parts:
        data["one_stream"] = one_stream(a, raw)
        tables.append(one_stream_markdown({**data["one_stream"], "machine": data["machine"]}))
    (out / "compare.json").write_text(json.dumps(data, indent=1))
    table = "\n".join(tables)
    (out / "compare.md").write_text(table)
    print(table)
    return data


def serve(a, raw: Path) -> dict:
    """The served part: both servers on one GGUF (--model; the default model's own file by default),
    `vllm bench serve` per rate and seed. The prompts are counted with the default model's tokenizer,
    which the shapes `tandem model dummy` writes carry."""
    model_dir, default_gguf = default_model()
    (name, gguf), = gguf_files(a.model).items()
    mine = model_dir if gguf == default_gguf else gguf      # the default: its converted directory, as before
    binary = Path(a.llama_server).resolve()
    cores = str(os.cpu_count() or 1)
    servers = {
        "llamacpp": ([str(binary), "-m", str(gguf), "--alias", model_dir.name, "--host", "127.0.0.1",
                      "--port", "18002", "-t", cores, "-tb", cores, "--parallel", str(a.slots),
                      "-c", str(2048 * a.slots), "--jinja",
                      "--temp", "1.0", "--top-k", "0", "--top-p", "1.0", "--min-p", "0.0"], 18002, None),
        "tandem": ([tandem_bin(), "serve", "--model", str(mine), "--served-model-name", model_dir.name,
                    "--port", "18001"] + a.tandem_args.split(), 18001, None),
    }
    data = {"llama_version": llama_version(binary), "llama_cmd": servers["llamacpp"][0], "model": name,
            "file": str(gguf), "rates": a.rates, "seeds": a.seeds, "num_prompts": a.num_prompts,
            "max_concurrency": a.max_concurrency, "slots": a.slots, "ttft_ms": a.ttft_ms, "tpot_ms": a.tpot_ms,
            "tandem_args": a.tandem_args}
    log(data["llama_version"])
    engines = a.engines.split(",")
    runs = serve_rounds(a, peer_dir(), model_dir, {k: v for k, v in servers.items() if k in engines}, raw)
    data["runs"] = runs
    data["medians"] = serve_medians(runs, a.rates)
    return data


def default_model() -> tuple[Path, Path]:
    """The default model's converted directory and, beside it, its own GGUF (fetched once)."""
    from tandem.models.fetch import DEFAULT_GGUF_MEMBER, fetch_default_model

    model_dir = fetch_default_model(progress=False)
    return model_dir, model_dir.parent / Path(DEFAULT_GGUF_MEMBER).name


def gguf_spec(spec: str | None) -> dict[str, str]:
    """--model of the one-stream part: comma-separated `FILE`, `NAME=FILE` or `default` (the default
    model's own GGUF, not fetched here) -> {name: file}, a name defaulting to the file's stem. A
    ValueError names a file that does not exist or a name given twice."""
    from tandem.models.fetch import DEFAULT_GGUF_MEMBER

    files: dict[str, str] = {}
    for item in (spec or "default").split(","):
        name, _, file = item.rpartition("=")
        if file != "default" and not Path(file).expanduser().is_file():
            raise ValueError(f"--model: no GGUF file {file!r}")
        name = name or Path(DEFAULT_GGUF_MEMBER if file == "default" else file).stem
        if name in files:
            raise ValueError(f"--model: two files named {name!r} (name them: NAME=FILE)")
        files[name] = file
    return files


def gguf_files(spec: str | None) -> dict[str, Path]:
    """`gguf_spec`'s files as paths, the default model's fetched where named."""
    return {name: default_model()[1] if file == "default" else Path(file).expanduser()
            for name, file in gguf_spec(spec).items()}


def one_stream(a, raw: Path) -> dict:
    """The one-stream part (see the module's docstring): rounds of Tandem then llama-bench per file."""
    binary = Path(a.llama_bench).resolve()
    threads = os.cpu_count() or 1
    files = gguf_files(a.model)
    rounds: list[dict] = []
    for r in range(a.rounds):
        for name, path in files.items():
            mine = tandem_one_stream(path, a.max_tokens, raw / f"one-stream-tandem-{name}-round{r}.json")
            theirs = llama_bench(binary, path, a.max_tokens, threads)
            rounds.append({"round": r, "model": name, "file": str(path), "tandem": mine, "llamacpp": theirs})
            log(f"round {r + 1} {name}: Tandem {mine['decode_tok_s']:.2f} tok/s (RSS {mine['peak_rss_mb']:.0f} MB, "
                f"bandwidth {mine['bandwidth_gbs']:.0f} GB/s), llama.cpp {theirs['tok_s']:.2f} tok/s")
    summary = {}
    for name, path in files.items():
        mine = [x for x in rounds if x["model"] == name]
        ours = statistics.median(x["tandem"]["decode_tok_s"] for x in mine)
        theirs = statistics.median(x["llamacpp"]["tok_s"] for x in mine)
        rss = statistics.median(x["tandem"]["peak_rss_mb"] for x in mine)
        size = path.stat().st_size
        budget_mb = (size + ONE_STREAM_KV_GB * 2**30) / 2**20
        summary[name] = {"file_bytes": size, "tandem_tok_s": ours, "llamacpp_tok_s": theirs,
                         "ratio": ours / theirs,
                         "ratios_per_round": [x["tandem"]["decode_tok_s"] / x["llamacpp"]["tok_s"] for x in mine],
                         "peak_rss_mb": rss, "rss_over_file_plus_kv": rss / budget_mb}
    return {"llama_version": llama_version(binary), "max_tokens": a.max_tokens, "threads": threads,
            "rounds": rounds, "summary": summary}


def tandem_one_stream(path: Path, max_tokens: int, out: Path) -> dict:
    cmd = [tandem_bin(), "bench", "offline", "--model", str(path), "--concurrency", "1", "--max-tokens",
           str(max_tokens), "--repeats", "3", "--max-model-len", "2048", "--kv-cache-memory-gb",
           str(ONE_STREAM_KV_GB), "--json", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"tandem bench offline failed on {path}:\n{p.stderr[-3000:]}")
    data = json.loads(out.read_text())
    steps = [r["decode_step_ms"] for r in data["results"][0]["runs"]]
    step = statistics.median(steps)
    return {"decode_tok_s": 1e3 / step, "decode_step_ms": step, "runs_step_ms": steps,
            "peak_rss_mb": data["peak_rss_mb"], "bandwidth_gbs": data["bandwidth_gbs"],
            "bytes_per_parameter": data["bytes_per_parameter"], "dtype": data["dtype"]}


def llama_bench(binary: Path, path: Path, max_tokens: int, threads: int) -> dict:
    p = subprocess.run([str(binary), "-m", str(path), "-p", "0", "-n", str(max_tokens), "-r", "3", "-t", str(threads),
                        "-o", "json"], capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"llama-bench failed on {path}:\n{p.stderr[-3000:]}")
    row = json.loads(p.stdout)[0]
    return {"tok_s": row["avg_ts"], "samples_ts": row.get("samples_ts"), "model_type": row.get("model_type"),
            "build": row.get("build_commit")}


def one_stream_markdown(data: dict) -> str:
    lines = [f"One stream, Tandem vs llama.cpp's llama-bench ({data['llama_version']}), same GGUF, alternating "
             f"rounds ({data['machine']}); decode tokens/s, medians of {len(data['rounds']) // len(data['summary'])} "
             f"rounds, {data['max_tokens']} tokens, {data['threads']} threads:", "",
             "| model | file GB | llama.cpp tok/s | Tandem tok/s | Tandem / llama.cpp (rounds) | Tandem peak RSS |",
             "|---|---:|---:|---:|---:|---|"]
    for name, s in data["summary"].items():
        rounds = ", ".join(f"{v:.2f}" for v in s["ratios_per_round"])
        lines.append(f"| {name} | {s['file_bytes'] / 1e9:.2f} | {s['llamacpp_tok_s']:.2f} | {s['tandem_tok_s']:.2f} | "
                     f"**{s['ratio']:.2f}x** ({rounds}) | {s['peak_rss_mb']:.0f} MB, "
                     f"{s['rss_over_file_plus_kv']:.2f}x file + KV |")
    return "\n".join(lines) + "\n"
