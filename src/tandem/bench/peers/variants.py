"""Tandem against itself under other flags, served, judged by `vllm bench serve`:
`tandem bench compare --peer tandem --variants NAME=FLAGS [--variants NAME=FLAGS ...]`.

Each variant is `tandem serve` of the default model with its flags. The seed rounds are the vLLM
comparison's served part (peers.vllm.serve_rounds: per seed round every variant in turn, started,
warmed up, driven at every rate, stopped; the same prompts per (rate, seed) for every variant), so
machine drift falls on all variants alike. Writes OUT/compare.json (every run and the medians over
seeds) and OUT/compare.md (per rate and metric, each variant's median and its ratio to the first
variant), the raw runs under OUT/raw/. Run it from a frozen clone: every server starts from this
checkout's .venv (peers.tandem_bin).
"""

from __future__ import annotations

import json
from pathlib import Path

from tandem.bench.peers import tandem_bin
from tandem.bench.peers.report import SERVE_METRICS, serve_medians
from tandem.bench.peers.vllm import log, peer_dir, serve_rounds


def parse_variants(items: list[str]) -> dict[str, list[str]]:
    """`NAME=FLAGS` items -> {name: flags}; a ValueError for an item without a name or a repeated name."""
    variants: dict[str, list[str]] = {}
    for item in items:
        name, sep, flags = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"--variants: NAME=FLAGS, got {item!r}")
        if name in variants:
            raise ValueError(f"--variants: {name!r} given twice")
        variants[name] = flags.split()
    return variants


def markdown(data: dict) -> str:
    names = list(data["variants"])
    lines = [f"Tandem's served variants on {data['machine']}, one after the other; `vllm bench serve`, ShareGPT, "
             f"{data['num_prompts']} prompts, chat endpoint; medians over seeds {data['seeds']}; goodput: TTFT <= "
             f"{data['ttft_ms']} ms and TPOT <= {data['tpot_ms']} ms; ratio to `{names[0]}`.", "",
             "| rate | metric | " + " | ".join(names) + " |", "|---:|---|" + "---:|" * len(names)]
    for rate, per in data["medians"].items():
        for key, label, _ in SERVE_METRICS:
            base = per.get(names[0], {}).get(key)
            cells = []
            for n in names:
                v = per.get(n, {}).get(key)
                ratio = f" ({v / base:.2f}x)" if v is not None and base and n != names[0] else ""
                cells.append("-" if v is None else f"{v:.2f}{ratio}")
            lines.append(f"| {float(rate):g} | {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def compare(a) -> dict:
    """The comparison `--peer tandem` runs, `a` its options (a.variants: {name: flags})."""
    from tandem.bench.common import machine_info
    from tandem.models.fetch import resolve_model

    out = Path(a.out)
    raw = out / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    model_dir = resolve_model(None, progress=False)
    servers = {name: ([tandem_bin(), "serve", "--model", str(model_dir), "--port", "18001"] + flags, 18001, None)
               for name, flags in a.variants.items()}
    data = {"machine": machine_info(), "variants": {n: " ".join(f) for n, f in a.variants.items()},
            "rates": a.rates, "seeds": a.seeds, "num_prompts": a.num_prompts, "ttft_ms": a.ttft_ms,
            "tpot_ms": a.tpot_ms}
    log(f"machine {data['machine']}, variants {data['variants']}")
    runs = serve_rounds(a, peer_dir(), model_dir, servers, raw)
    data["runs"] = runs
    data["medians"] = serve_medians(runs, a.rates)
    (out / "compare.json").write_text(json.dumps(data, indent=1))
    table = markdown(data)
    (out / "compare.md").write_text(table)
    print(table)
    return data
