"""Can drafting and verification share this CPU better concurrently than one after the other?

The mechanism behind FASER's overlap, without the engine around it: one verification pass of the
default model (C requests x F rows) and F layer-skip draft passes (C rows, the first L layers plus
the LM head) are timed
  - one after the other, each with every thread (what Tandem does without overlap), and
  - at the same time, verification on the calling thread and drafting on a second thread, with
    the threads split between them (what `overlap=True` does while both run).
Interleaved, medians of `--repeats`; the ratio is sequential / concurrent (> 1: overlap can pay).

    .venv/bin/python scripts/probe_overlap.py --layers 8 --concurrency 1,4 --frontier 4 [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import torch

from tandem import LLM, SamplingParams
from tandem.runner.inputs import build_inputs
from tandem.types import ScheduledSeq, StepPlan


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8, help="draft layers (layer-skip)")
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--frontier", type=int, default=4, help="rows verified per pass = draft passes per frontier")
    ap.add_argument("--context", type=int, default=200, help="tokens already in each request's KV")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    llm = LLM(progress=False)
    runner = llm.engine.executor
    model, attn, bs = runner.model, runner.attn, runner.block_size
    total = torch.get_num_threads()
    params = SamplingParams(max_tokens=1, temperature=0)
    blocks_per_req = (a.context + 2 * a.frontier) // bs + 1

    def inputs(c: int, rows: int, first_req: int, start: int):
        seqs = [ScheduledSeq(f"r{i}", [1] * rows, start, list(range(i * blocks_per_req, (i + 1) * blocks_per_req)),
                             True, params, 0) for i in range(first_req, first_req + c)]
        return build_inputs(StepPlan(seqs), bs, runner.device, runner.paged_kernel)

    out = {"layers": a.layers, "frontier": a.frontier, "threads": total, "points": {}}
    for c in [int(x) for x in a.concurrency.split(",")]:
        verify_in = inputs(c, a.frontier, 0, a.context)
        draft_in = inputs(c, 1, c, a.context + a.frontier)

        @torch.inference_mode()
        def verify(verify_in=verify_in):
            model.compute_logits(model(verify_in.input_ids, verify_in.positions, attn, verify_in.meta))

        @torch.inference_mode()
        def draft(draft_in=draft_in):
            for _ in range(a.frontier):
                h = model(draft_in.input_ids, draft_in.positions, attn, draft_in.meta, a.layers)
                model.compute_logits(h)

        def concurrent():
            def worker():
                torch.set_num_threads(max(1, total // 2))
                draft()
            t = threading.Thread(target=worker)
            t.start()
            torch.set_num_threads(max(1, total - total // 2))
            verify()
            torch.set_num_threads(total)
            t.join()

        def timed(fn) -> float:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0

        for _ in range(2):
            verify(), draft(), concurrent()
        seq, conc, v, d = [], [], [], []
        for _ in range(a.repeats):
            v.append(timed(verify))
            d.append(timed(draft))
            seq.append(v[-1] + d[-1])
            conc.append(timed(concurrent))
        point = {"verify_ms": 1e3 * statistics.median(v), "draft_ms": 1e3 * statistics.median(d),
                 "sequential_ms": 1e3 * statistics.median(seq), "concurrent_ms": 1e3 * statistics.median(conc),
                 "ratio_seq_over_conc": statistics.median(s / x for s, x in zip(seq, conc))}
        out["points"][str(c)] = point
        print(f"C={c:<3} verify {point['verify_ms']:6.1f} ms  draft x{a.frontier} {point['draft_ms']:6.1f} ms  "
              f"sequential {point['sequential_ms']:6.1f} ms  concurrent {point['concurrent_ms']:6.1f} ms  "
              f"ratio {point['ratio_seq_over_conc']:.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
