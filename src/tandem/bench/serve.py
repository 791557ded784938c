"""`tandem bench serve`: a load generator for any OpenAI-compatible endpoint (Tandem, vLLM, llama.cpp, ...).

Owns the run: which items are sent when. Open loop (`rates`: arrivals from workload/arrivals.py,
Poisson, gamma or diurnal, one run per rate in a sweep) or closed loop (`concurrency` workers each
sending the next item as soon as the previous one finishes), bounded by a number of requests or a
duration (no new request is sent after it; those in flight finish). Items come from
workload/datasets.py. The wire side is serve_client.py, the figures serve_metrics.py, the pictures
plots.py. Results: config, per-run summaries and per-request records as JSON.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable

import httpx
from tqdm import tqdm

from tandem.bench.common import write_json
from tandem.bench.serve_client import RequestRecord, Target, run_item
from tandem.bench.serve_metrics import format_summary, summarize
from tandem.workload.arrivals import make_arrivals
from tandem.workload.datasets import WorkItem, load_dataset

CLOSED_LOOP_POOL = 1000          # items drawn for a duration-bounded closed loop (cycled)


@dataclass
class ServeBenchConfig:
    url: str
    dataset: str = "prompts"
    model: str | None = None
    endpoint: str = "chat"
    rates: list[float] = field(default_factory=list)      # open loop; empty: closed loop
    concurrency: int | None = None
    num_requests: int | None = None
    duration_s: float | None = None
    arrival: str = "poisson"          # poisson | gamma | diurnal | trace file
    burstiness: float = 1.0           # gamma CV
    peak_valley_ratio: float = 10.0   # diurnal
    max_tokens: int | None = None
    temperature: float = 0.0
    ignore_eos: bool = False
    slos_ms: dict[str, float] = field(default_factory=dict)
    seed: int = 0
    api_key: str | None = None
    timeout_s: float = 600.0
    json_path: str | None = None
    plots_dir: str | None = None
    progress: bool = True

    def validate(self) -> None:
        if bool(self.rates) == (self.concurrency is not None):
            raise ValueError("give request rate(s) or a concurrency, not both")
        if self.num_requests is None and self.duration_s is None:
            raise ValueError("give a number of requests or a duration")
        if any(math.isinf(r) for r in self.rates) and self.num_requests is None:
            raise ValueError("an infinite rate needs --num-requests")
        if self.endpoint not in ("chat", "completions"):
            raise ValueError(f"endpoint must be chat or completions, not {self.endpoint!r}")


def base_url(url: str) -> str:
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def discover_model(url: str, api_key: str | None, log: Callable[[str], None]) -> str:
    """The first model the server lists, or "default" (with a warning) if it cannot be asked."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(f"{url}/v1/models", headers=headers, timeout=10)
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        log(f"warning: could not list models at {url}/v1/models ({type(e).__name__}); "
            "sending model 'default'")
        return "default"


def make_client(cfg: ServeBenchConfig) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout_s, connect=10.0), limits=limits)


async def run_open_loop(cfg: ServeBenchConfig, target: Target, items: list[WorkItem],
                        arrivals: list[float], bar: tqdm) -> tuple[list[RequestRecord], float]:
    """Send item i at arrivals[i] (seconds from the start); wait for all to finish."""
    async with make_client(cfg) as client:
        start, tasks = time.perf_counter(), []
        for i, (item, t) in enumerate(zip(items, arrivals)):
            delay = start + t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_tracked(client, target, item, i, start, cfg.seed, bar)))
        records = await asyncio.gather(*tasks)
        return list(records), time.perf_counter() - start


async def run_closed_loop(cfg: ServeBenchConfig, target: Target, items: list[WorkItem],
                          bar: tqdm) -> tuple[list[RequestRecord], float]:
    """`cfg.concurrency` workers, each sending the next item when its previous one is done."""
    counter, records = itertools.count(), []
    async with make_client(cfg) as client:
        start = time.perf_counter()

        async def worker() -> None:
            while True:
                i = next(counter)
                if cfg.num_requests is not None and i >= cfg.num_requests:
                    return
                if cfg.duration_s is not None and time.perf_counter() - start >= cfg.duration_s:
                    return
                records.append(await _tracked(client, target, items[i % len(items)], i, start, cfg.seed, bar))

        await asyncio.gather(*(worker() for _ in range(cfg.concurrency or 1)))
        return sorted(records, key=lambda r: r.index), time.perf_counter() - start


async def _tracked(client: httpx.AsyncClient, target: Target, item: WorkItem, i: int, start: float,
                   seed: int, bar: tqdm) -> RequestRecord:
    rec = await run_item(client, target, item, i, start, seed)
    bar.update(1)
    return rec


def run_one(cfg: ServeBenchConfig, target: Target, rate: float | None,
            count_tokens: Callable[[str], int] | None) -> dict[str, Any]:
    """One run (one rate, or the closed loop) -> its summary and per-request records."""
    rng = random.Random(cfg.seed)
    if rate is not None:
        arrivals = make_arrivals(cfg.arrival, rate, rng, cfg.num_requests, cfg.duration_s, cv=cfg.burstiness,
                                 peak_valley_ratio=cfg.peak_valley_ratio)
        items = load_dataset(cfg.dataset, max(1, len(arrivals)), cfg.seed, count_tokens)
        total, label = len(arrivals), f"rate {rate:g}/s"
    else:
        items = load_dataset(cfg.dataset, cfg.num_requests or CLOSED_LOOP_POOL, cfg.seed, count_tokens)
        total, label = cfg.num_requests, f"concurrency {cfg.concurrency}"
    with tqdm(total=total, desc=label, unit="req", disable=not cfg.progress, leave=False) as bar:
        if rate is not None:
            records, duration = asyncio.run(run_open_loop(cfg, target, items, arrivals, bar))
        else:
            records, duration = asyncio.run(run_closed_loop(cfg, target, items, bar))
    mode = {"rate": rate, "arrival": cfg.arrival} if rate is not None else {"concurrency": cfg.concurrency}
    return {"label": label, **mode, "summary": summarize(records, duration, cfg.slos_ms or None),
            "requests": [r.to_dict() for r in records]}


def bench_serve(cfg: ServeBenchConfig, count_tokens: Callable[[str], int] | None = None,
                token_counter: str = "estimate", log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run every configured rate (or the closed loop), write JSON and plots, return the results."""
    cfg.validate()
    started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    url = base_url(cfg.url)
    model = cfg.model or discover_model(url, cfg.api_key, log)
    target = Target(url, model, cfg.endpoint, cfg.api_key, cfg.max_tokens, cfg.temperature, cfg.ignore_eos)
    runs = []
    for rate in (cfg.rates or [None]):
        run = run_one(cfg, target, rate, count_tokens)
        log(format_summary(f"{run['label']} ({cfg.dataset})", run["summary"]))
        runs.append(run)
    config = {k: v for k, v in asdict(cfg).items() if k not in ("api_key", "progress")}
    data = {"bench": "serve", "started_at": started_at,
            "url": url, "model": model, "dataset": cfg.dataset, "token_counter": token_counter,
            "config": config, "runs": runs}
    write_json(cfg.json_path, data)
    if cfg.plots_dir:
        from tandem.bench.plots import plot_serve_results

        data["plots"] = plot_serve_results(runs, cfg.plots_dir, title=f"{model} / {cfg.dataset}")
        write_json(cfg.json_path, data)
    return data
