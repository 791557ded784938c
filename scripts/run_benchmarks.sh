#!/usr/bin/env bash
# Re-measure every figure in docs/benchmarks.md on this machine (quiet machine: nothing else running).
# Results land in docs/results/*.json and docs/img/*.png. About 1.5 hours on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
OUT=docs/results
mkdir -p "$OUT" docs/img

# Issue 2: engine core, concurrency 1 and 32 (3 interleaved repeats, medians).
$BIN/tandem bench offline --concurrency 1,32 --repeats 3 --json $OUT/offline.json

# Issue 3: FASER policies across load, per prompt kind at concurrency 1, and the pruning ablation.
$BIN/tandem bench spec --concurrency 1,2,4,8,16,32,64 \
  --policies no-sd,fixed-2,fixed-4,fixed-8,bs-table,adaptive --repeats 1 --requests-per-point 16 \
  --kinds chat,rewrite,extract,code --kind-requests 4 --json $OUT/spec.json --plot docs/img/spec_sweep.png
$BIN/tandem bench spec --concurrency 1,8,64 --policies adaptive,adaptive+frontiers,adaptive+early-exit \
  --repeats 1 --requests-per-point 16 --kinds "" --json $OUT/spec_ablation.json

# Issue 4: tool-augmented mixture at three Poisson rates (scaled trace: see docs/benchmarks.md).
$BIN/tandem bench augmented --policies fcfs-discard,infercept,augserve-stage1,augserve-stage2,augserve \
  --rates 0.3,1.0,2.0 --num-requests 40 --token-scale 0.25 --time-scale 0.25 --json $OUT/augmented.json

# Issue 5: the HTTP server under the load generator, and its overhead against the offline engine.
$BIN/tandem serve --port 8765 > /tmp/tandem-serve.log 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 60); do curl -sf http://127.0.0.1:8765/health >/dev/null && break; sleep 2; done
$BIN/tandem bench serve --url http://127.0.0.1:8765 --rates 0.5,1,2 --num-requests 48 --dataset prompts \
  --goodput ttft:2000 tpot:150 --json $OUT/serve.json --plots docs/img
$BIN/tandem bench serve --url http://127.0.0.1:8765 --concurrency 32 --num-requests 64 --dataset prompts \
  --ignore-eos --json $OUT/serve_c32.json
kill $SERVER
