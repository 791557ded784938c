#!/usr/bin/env bash
# Re-measure the engine's own benchmark files in docs/results/ on this machine (docs/results/README.md
# says which doc table each backs; the peer comparisons are scripts/compare_*.py). Run it on a quiet machine
# (nothing else running: on 2 cores a second process halves every figure). About 2 hours.
# Pieces: offline profile spec spec-repeats spec-kinds ablation auto-frontiers overlap augmented augmented-overload augmented-tight serve
# (scripts/run_benchmarks.sh PIECE...; default: all)
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
OUT=docs/results
mkdir -p "$OUT" docs/img
PIECES=${*:-offline profile spec spec-repeats spec-kinds ablation auto-frontiers overlap augmented augmented-overload augmented-tight serve}

for piece in $PIECES; do
case $piece in
offline)  # Issue 2: engine core, concurrency 1 and 32 (3 interleaved repeats, medians).
  $BIN/tandem bench offline --concurrency 1,32 --repeats 3 --json $OUT/offline.json ;;
profile)  # Issue 2: where a decode step's time goes (concurrency 1 and 32).
  $BIN/python scripts/profile_step.py --concurrency 1,32 --json $OUT/profile.json ;;
spec)     # Issue 3: FASER policies across load (n-gram drafts), and per prompt kind at concurrency 1.
  $BIN/tandem bench spec --concurrency 1,2,4,8,16,32,64 --requests-per-point 8 --requests-per-slot 2 \
    --policies no-sd,fixed-2,fixed-4,fixed-8,bs-table,survival,adaptive --repeats 1 \
    --kinds chat,rewrite,extract,code --kind-requests 2 --json $OUT/spec.json --plot docs/img/spec_sweep.png ;;
spec-repeats) # Issue 3: the claims that single runs are too noisy for, with 3 interleaved repeats.
  $BIN/tandem bench spec --concurrency 64 --requests-per-point 8 --requests-per-slot 2 --policies no-sd,adaptive \
    --repeats 3 --kinds chat --kind-requests 4 --json $OUT/spec_repeats.json ;;
spec-kinds) # Issue 3: per prompt kind at concurrency 1, all 4 prompts of a kind, 3 interleaved repeats.
  $BIN/tandem bench spec --concurrency 1 --requests-per-point 2 --policies fixed-8,adaptive,no-sd \
    --kinds code,chat --kind-requests 4 --repeats 3 --json $OUT/spec_kinds_repeats.json ;;
ablation) # Issue 3: early pruning (frontiers, intermediate-layer early exit) on top of adaptive.
  $BIN/tandem bench spec --concurrency 1,8 --policies no-sd,adaptive,adaptive+frontiers,adaptive+early-exit \
    --repeats 2 --requests-per-point 8 --kinds "" --json $OUT/spec_ablation.json ;;
auto-frontiers) # Issue 3: frontiers chosen per step by the scheduler, against never and always.
  $BIN/tandem bench spec --concurrency 1,8 --policies adaptive,adaptive+frontiers,adaptive+auto-frontiers,fixed-8,fixed-8+frontiers,fixed-8+auto-frontiers \
    --repeats 3 --requests-per-point 8 --kinds "" --json $OUT/spec_auto_frontiers.json ;;
overlap)  # Issue 3: drafting overlapped with verification, for a draft model (the target itself: all
          # accepted) and layer-skip drafts; plus the mechanism probe (concurrent vs sequential passes).
  $BIN/tandem bench spec --speculative draft --draft-model "$($BIN/python -c 'from tandem.models.fetch import fetch_default_model as f; print(f(progress=False))')" \
    --concurrency 1,4 --policies fixed-8,fixed-8+frontiers,fixed-8+overlap --repeats 5 \
    --requests-per-point 4 --kinds "" --max-tokens 64 --json $OUT/spec_overlap_selfdraft.json
  $BIN/tandem bench spec --speculative layerskip --num-draft-layers 8 --concurrency 1,4 \
    --policies no-sd,fixed-8+frontiers,fixed-8+overlap,adaptive,adaptive+overlap --repeats 5 \
    --requests-per-point 4 --kinds "" --max-tokens 64 --json $OUT/spec_overlap_layerskip.json
  $BIN/python scripts/probe_overlap.py --layers 8 --concurrency 1,4 --frontier 4 --json /tmp/probe_l8.json
  $BIN/python scripts/probe_overlap.py --layers 30 --concurrency 1,4 --frontier 4 --json /tmp/probe_l30.json
  $BIN/python -c "import json; json.dump({'layers_8': json.load(open('/tmp/probe_l8.json')), 'layers_30': json.load(open('/tmp/probe_l30.json'))}, open('$OUT/overlap_probe.json', 'w'), indent=2)" ;;
augmented) # Issue 4: tool-augmented mixture at three Poisson rates (scaled trace: see docs/benchmarks.md).
  $BIN/tandem bench augmented --policies fcfs-discard,infercept,augserve-stage1,augserve-stage2,augserve \
    --rates 0.5,1.0,2.0 --num-requests 24 --token-scale 0.25 --time-scale 0.25 --json $OUT/augmented.json ;;
augmented-overload) # Issue 4: overloaded: 48 requests at 8 req/s (the queue and the KV cache fill up).
  $BIN/tandem bench augmented --policies fcfs-discard,infercept,augserve-stage1,augserve-stage2,augserve \
    --rates 8.0 --num-requests 48 --token-scale 0.25 --time-scale 0.25 --json $OUT/augmented_overload.json ;;
augmented-tight) # Issue 4: with a 0.1 GB KV cache, the regime where memory binds.
  $BIN/tandem bench augmented --policies fcfs-discard,infercept,augserve --rates 4.0 --num-requests 48 \
    --token-scale 0.25 --time-scale 0.25 --kv-cache-memory-gb 0.1 --json $OUT/augmented_tight.json ;;
serve)    # Issue 5: the HTTP server under the load generator, and its overhead against the engine.
  $BIN/tandem serve --port 8765 > /tmp/tandem-serve.log 2>&1 &
  SERVER=$!
  trap 'kill $SERVER 2>/dev/null || true' EXIT
  for _ in $(seq 90); do curl -sf http://127.0.0.1:8765/health >/dev/null && break; sleep 2; done
  $BIN/tandem bench serve --url http://127.0.0.1:8765 --rates 0.5,1,2 --num-requests 24 --dataset prompts \
    --goodput ttft:2000 tpot:150 --json $OUT/serve.json --plots docs/img
  $BIN/tandem bench serve --url http://127.0.0.1:8765 --concurrency 32 --num-requests 64 --dataset prompts --max-tokens 128 \
    --ignore-eos --json $OUT/serve_c32.json
  kill $SERVER; trap - EXIT ;;
*) echo "unknown piece: $piece" >&2; exit 2 ;;
esac
done
