"""`tandem`: command-line entry point.

    tandem serve [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--model PATH] [--replicas N]
    tandem generate "prompt" [--chat] [--max-tokens N] [--temperature T] [--model PATH]
    tandem model fetch [--model PATH]
    tandem bench offline [--concurrency 1,32] [--repeats 3] [--json PATH]
    tandem bench perplexity --text FILE [--ctx 512] [--chunks N] [--quantization Q] [--json PATH]
    tandem bench serve --url URL (--rate R | --rates R1,R2 | --concurrency C) [--dataset D] [--json PATH]
    tandem bench compare --peer vllm|llamacpp [--llama-server PATH] [--out DIR] [--json PATH]
    tandem simulate --scenario faser|augserve|FILE [--json PATH] [--plots DIR]   (also: calibrate, speed)
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from tandem.bench.cli_args import add_agents_parser, add_calibrate_parser, add_serve_parser
from tandem.bench.peers.cli import add_compare_parser
from tandem.cli_engine import SERVE_BATCHED_TOKENS, add_model_args, make_llm, served_model_name
from tandem.cli_serve import add_serve_arguments
from tandem.errors import TandemError
from tandem.models.shapes import SHAPES
from tandem.sim.cli_args import add_predictor_parser, add_simulate_parser


def cmd_generate(a: argparse.Namespace) -> int:
    from tandem.sampling_params import SamplingParams

    llm = make_llm(a)
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, seed=a.sample_seed)
    if a.chat:
        out = llm.chat([{"role": "user", "content": a.prompt}], params)[0]
    else:
        out = llm.generate(a.prompt, params)[0]
    print(out.text)
    m = out.metrics
    print(f"[{len(out.token_ids)} tokens, finish={out.finish_reason}, ttft={m.ttft:.3f}s, total={m.e2e_latency:.3f}s]",
          file=sys.stderr)
    return 0


def cmd_serve(a: argparse.Namespace) -> int:
    if a.replicas < 1:
        from tandem.errors import ConfigError

        raise ConfigError(f"--replicas must be at least 1, got {a.replicas}")
    if a.replicas >= 2:                # N engines on Ray Serve behind one ingress (tandem.cluster)
        from tandem.cluster.launch import serve_cluster

        return serve_cluster(a)
    from tandem.engine.async_engine import AsyncLLMEngine
    from tandem.server.launch import serve

    built = {}

    def build():                      # on the engine thread (see AsyncLLMEngine)
        built["llm"] = make_llm(a)
        return built["llm"].engine

    engine = AsyncLLMEngine(build, max_waiting=a.max_waiting)
    llm = built["llm"]
    grammar = getattr(llm.engine, "grammar", None)
    if grammar is not None:            # build llguidance's tokenizer view (~1 s) now, not on a first request
        import threading

        threading.Thread(target=lambda: grammar.tokenizer, name="grammar-warmup", daemon=True).start()
    serve(engine, a.served_model_name or served_model_name(a.model), host=a.host, port=a.port, api_key=a.api_key,
          max_request_bytes=a.max_request_bytes, max_tokens_limit=a.max_tokens_limit,
          drain_timeout_s=a.drain_timeout, log_level="debug" if a.verbose else "info", tools=llm.tool_registry,
          metrics_prefixes=a.metrics_prefix, strict=a.strict, tool_parser=a.tool_call_parser,
          enable_auto_tool_choice=a.enable_auto_tool_choice, reasoning_parser=a.reasoning_parser,
          trust_request_chat_template=a.trust_request_chat_template)
    return 0


def cmd_model_fetch(a: argparse.Namespace) -> int:
    from tandem.models.fetch import resolve_model

    print(resolve_model(a.model, progress=True))
    return 0


def cmd_model_dummy(a: argparse.Namespace) -> int:
    from tandem.models.dummy_gguf import write_dummy_gguf

    print(write_dummy_gguf(a.config, a.quantization, Path(a.out), seed=a.seed, progress=True))
    return 0


def cmd_bench_offline(a: argparse.Namespace) -> int:
    from tandem.bench.offline import bench_offline

    conc = [int(x) for x in a.concurrency.split(",")]
    llm = make_llm(a, max_num_seqs=max(conc + [a.max_num_seqs]))
    data = bench_offline(llm, conc, repeats=a.repeats, dataset=a.dataset, max_tokens=a.max_tokens, json_path=a.json)
    print(f"\n{'C':>4} {'tok/s':>8} {'step ms':>8} {'roofline ms':>12} {'bound':>8} {'fraction':>9}")
    for r in data["results"]:
        print(f"{r['concurrency']:>4} {r['output_tok_s']:>8.1f} {r['decode_step_ms'] or 0:>8.1f} "
              f"{r['roofline_step_ms']:>12.1f} {r['bound']:>8} {r['roofline_fraction'] or 0:>9.2f}")
    print(f"peak RSS {data['peak_rss_mb']:.0f} MB, dtype {data['dtype']}, {data['parameters'] / 1e6:.1f} M parameters "
          f"in {data['weight_resident_bytes'] / 1e6:.0f} MB ({data['bytes_per_parameter']:.2f} bytes per parameter)")
    return 0


def cmd_bench_perplexity(a: argparse.Namespace) -> int:
    from tandem.bench.common import machine_info, write_json
    from tandem.bench.perplexity import perplexity

    try:
        text = Path(a.text).read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        print(f"tandem: error: --text {a.text}: {e.strerror or e}", file=sys.stderr)
        return 2
    llm = make_llm(a)
    try:
        data = perplexity(llm, text, ctx=a.ctx, max_chunks=a.chunks)
    except ValueError as e:
        print(f"tandem: error: {e}", file=sys.stderr)
        return 2
    data.update(text=a.text, quantization=a.quantization, machine=machine_info())
    write_json(a.json, data)
    print(f"perplexity {data['perplexity']:.4f} over {data['tokens_scored']} tokens "
          f"({data['chunks']} chunks of {data['ctx']}; {data['wall_s']:.1f} s)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat, completions, models, metrics)")
    add_serve_arguments(s)
    add_model_args(s, SERVE_BATCHED_TOKENS)
    s.set_defaults(func=cmd_serve)

    g = sub.add_parser("generate", help="generate text from one prompt")
    g.add_argument("prompt")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--sample-seed", type=int, default=None)
    add_model_args(g)
    g.set_defaults(func=cmd_generate)

    m = sub.add_parser("model", help="model management")
    msub = m.add_subparsers(dest="model_command", required=True)
    f = msub.add_parser("fetch", help="download and convert a model (default: SmolLM2-135M-Instruct)")
    f.add_argument("--model", default=None, help="HF directory, .gguf file or Hub repository org/name[@revision]")
    f.set_defaults(func=cmd_model_fetch)
    dm = msub.add_parser("dummy", help="write a GGUF of a model shape with random weights, tensor types mixed as "
                                      "llama.cpp's quantizer mixes them (for llama.cpp and Tandem on the same file)")
    dm.add_argument("--config", required=True, help=f"a shape ({', '.join(SHAPES)}) or a config.json")
    dm.add_argument("--quantization", required=True, choices=["Q4_K_M", "Q4_0", "Q8_0"])
    dm.add_argument("--out", required=True, help="the .gguf file to write")
    dm.add_argument("--seed", type=int, default=0)
    dm.set_defaults(func=cmd_model_dummy)

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    o = bsub.add_parser("offline", help="engine throughput at fixed concurrencies")
    o.add_argument("--concurrency", default="1,32")
    o.add_argument("--repeats", type=int, default=3)
    o.add_argument("--dataset", default=None, help="prompt-set JSONL (default: the bundled shared prompt set)")
    o.add_argument("--max-tokens", type=int, default=None, help="override each prompt's max_tokens")
    o.add_argument("--json", default=None, help="write the figures to this JSON file")
    add_model_args(o)
    o.set_defaults(func=cmd_bench_offline)
    pp = bsub.add_parser("perplexity", help="perplexity on a text, as llama.cpp's llama-perplexity computes it")
    pp.add_argument("--text", required=True, help="a UTF-8 text file")
    pp.add_argument("--ctx", type=int, default=512, help="tokens per chunk (the second half of each is scored)")
    pp.add_argument("--chunks", type=int, default=None, help="score at most this many chunks")
    pp.add_argument("--json", default=None, help="write the figures to this JSON file")
    add_model_args(pp)
    pp.set_defaults(func=cmd_bench_perplexity)
    add_serve_parser(bsub)
    add_agents_parser(bsub)
    add_compare_parser(bsub)
    sp = bsub.add_parser("spec", help="speculative decoding policies across load levels "
                                      "(n-gram drafts unless --speculative says otherwise)")
    sp.add_argument("--concurrency", default="1,2,4,8,16,32,64")
    sp.add_argument("--policies", default="no-sd,fixed-2,fixed-4,fixed-8,bs-table,adaptive")
    sp.add_argument("--repeats", type=int, default=3)
    sp.add_argument("--requests-per-point", type=int, default=16, help="requests per (policy, concurrency) run")
    sp.add_argument("--kinds", default="chat,rewrite,extract,code", help="per-kind runs at concurrency 1")
    sp.add_argument("--kind-requests", type=int, default=4)
    sp.add_argument("--requests-per-slot", type=float, default=3.0,
                    help="a point runs max(requests-per-point, this x C) requests (the tail's share)")
    sp.add_argument("--max-tokens", type=int, default=None, help="cap each prompt's max_tokens")
    sp.add_argument("--dataset", default="prompts",
                    help="prompts (the shared prompt set, by kind), sharegpt, humaneval-edit, humaneval-tools, ...")
    sp.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0 samples, seeded per request")
    sp.add_argument("--ignore-eos", action="store_true", help="run every request to its length (equal work per policy)")
    sp.add_argument("--json", default=None)
    sp.add_argument("--plot", default=None, help="PNG of tok/s against concurrency, one line per policy")
    add_model_args(sp)
    sp.set_defaults(func=cmd_bench_spec)
    ac = bsub.add_parser("acceptance", help="draft offers and acceptance per dataset, fitted for the simulator "
                                            "(n-gram drafts unless --speculative says otherwise)")
    ac.add_argument("--datasets", default="sharegpt,humaneval,prompts",
                    help="comma-separated: sharegpt, humaneval, prompts (per prompt kind) or files")
    ac.add_argument("--num-requests", type=int, default=40, help="requests per dataset")
    ac.add_argument("--draft-tokens", type=int, default=8, help="the fixed draft length k every round asks for")
    ac.add_argument("--temperature", type=float, default=1.0)
    ac.add_argument("--max-tokens", type=int, default=256, help="cap each request's output")
    ac.add_argument("--concurrency", type=int, default=8, help="requests in flight (acceptance is load-insensitive)")
    ac.add_argument("--json", default=None)
    add_model_args(ac)
    ac.set_defaults(func=cmd_bench_acceptance)
    au = bsub.add_parser("augmented", help="tool-augmented serving per scheduling policy (scripted traces)")
    au.add_argument("--policies", default="fcfs-discard,infercept,augserve")
    au.add_argument("--rates", default="0.1,0.25,0.5", help="Poisson request rates (req/s)")
    au.add_argument("--num-requests", type=int, default=40)
    au.add_argument("--repeats", type=int, default=1,
                    help="run each (rate, policy) this many times on the same trace (another trace: --trace-seed)")
    au.add_argument("--token-scale", type=float, default=1.0, help="scale the trace's token counts")
    au.add_argument("--time-scale", type=float, default=1.0, help="scale the trace's tool times")
    au.add_argument("--slo-ttft", type=float, default=5.0, help="SLO: TTFT bound (s)")
    au.add_argument("--slo-norm-latency", type=float, default=0.25, help="SLO: (e2e - tool time)/token bound (s)")
    au.add_argument("--trace-seed", type=int, default=1)
    au.add_argument("--predictor", default="train", metavar="train|cold|PATH",
                    help="Stage I predictor: train on a held-out trace (seed + 1000; default), start cold, "
                         "or a state from `tandem predictor train`")
    au.add_argument("--json", default=None)
    au.add_argument("--step-trace", default=None, metavar="PATH",
                    help="write every run's per-step scheduler trace here (JSON lines)")
    au.add_argument("--stall", default=None, metavar="SECONDS@AT",
                    help="disturb each run: stop stepping for SECONDS once it has lasted AT seconds")
    add_model_args(au, block_size=16)      # the tiny caches of the memory-bound runs count 16-token blocks
    au.set_defaults(func=cmd_bench_augmented)
    add_simulate_parser(sub, subcommands=[add_calibrate_parser])
    add_predictor_parser(sub)
    return p


def _read_predictor(path: str) -> dict | bool:
    from tandem.sim.predictor import check

    try:
        state = json.loads(Path(path).read_text())
        check(state)
    except (OSError, ValueError) as e:
        print(f"tandem: error: --predictor {path}: {e}", file=sys.stderr)
        return False
    return state


def cmd_bench_augmented(a: argparse.Namespace) -> int:
    from tandem.bench.augmented import bench_augmented
    from tandem.sched.policies import POLICY_NAMES

    policies = a.policies.split(",")
    unknown = [p for p in policies if p not in POLICY_NAMES]
    if unknown:
        print(f"tandem: error: unknown policies {unknown}; known: {POLICY_NAMES}", file=sys.stderr)
        return 2
    rates = [float(x) for x in a.rates.split(",")]
    predictor = None if a.predictor == "train" else {} if a.predictor == "cold" else _read_predictor(a.predictor)
    if predictor is False:
        return 2
    stall = None
    if a.stall:
        try:
            stall = tuple(float(x) for x in a.stall.split("@"))
            if len(stall) != 2 or min(stall) < 0:
                raise ValueError
        except ValueError:
            print(f"tandem: error: --stall wants SECONDS@AT, both >= 0 (e.g. 4@12), got {a.stall!r}",
                  file=sys.stderr)
            return 2
    llm = make_llm(a, tools=True)
    data = bench_augmented(llm, policies, rates, a.num_requests, a.trace_seed, a.token_scale, a.time_scale,
                           (a.slo_ttft, a.slo_norm_latency), a.repeats, a.json, predictor=predictor,
                           steps_path=a.step_trace, stall=stall)
    print(f"\n{'rate':>6} {'policy':<16} {'eff req/s':>9} {'SLO':>5} {'TTFT p50':>9} {'TTFT p99':>9}")
    for r in rates:
        for p in policies:
            x = data["results"][str(r)][p][-1]
            print(f"{r:>6} {p:<16} {x['effective_throughput_rps']:>9.3f} {x['slo_attainment']:>5.0%} "
                  f"{x['ttft_p50_s']:>9.2f} {x['ttft_p99_s']:>9.2f}")
    return 0


def cmd_bench_acceptance(a: argparse.Namespace) -> int:
    from tandem.bench.acceptance import bench_acceptance
    from tandem.config import SpecConfig

    if a.draft_tokens < 1 or a.num_requests < 1 or a.concurrency < 1:
        print("tandem: error: --draft-tokens, --num-requests and --concurrency must be >= 1", file=sys.stderr)
        return 2
    spec = SpecConfig(method=a.speculative or "ngram", max_draft_tokens=a.draft_tokens, draft_model=a.draft_model,
                      draft_quantization=a.draft_quantization, num_draft_layers=a.num_draft_layers)
    llm = make_llm(a, speculative=spec)
    try:
        bench_acceptance(llm, [d for d in a.datasets.split(",") if d], a.num_requests, a.draft_tokens,
                         a.temperature, a.max_tokens, a.concurrency, a.json, seed=a.seed or 0)
    except ValueError as e:
        print(f"tandem: error: {e}", file=sys.stderr)
        return 2
    return 0


def cmd_bench_spec(a: argparse.Namespace) -> int:
    from tandem.bench.spec import POLICIES, bench_spec
    from tandem.config import SpecConfig

    conc = [int(x) for x in a.concurrency.split(",")]
    policies = a.policies.split(",")
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        print(f"tandem: error: unknown policies {unknown}; known: {sorted(POLICIES)}", file=sys.stderr)
        return 2
    spec = SpecConfig(method=a.speculative or "ngram", max_draft_tokens=a.max_draft_tokens, draft_model=a.draft_model,
                      draft_quantization=a.draft_quantization,
                      num_draft_layers=a.num_draft_layers, frontier_size=a.frontier_size,
                      early_exit_layer=a.early_exit_layer)
    llm = make_llm(a, max_num_seqs=max(conc + [a.max_num_seqs]), speculative=spec)
    kinds = [k for k in a.kinds.split(",") if k] if a.dataset == "prompts" else []
    data = bench_spec(llm, conc, policies, a.repeats, a.requests_per_point, kinds, a.kind_requests, a.json, a.plot,
                      requests_per_slot=a.requests_per_slot, max_tokens=a.max_tokens, dataset=a.dataset,
                      temperature=a.temperature, ignore_eos=a.ignore_eos)
    print(f"\n{'policy':<10}" + "".join(f"{'C=' + str(c):>9}" for c in conc))
    for p in policies:
        print(f"{p:<10}" + "".join(f"{data['sweep'][p][str(c)]['output_tok_s']:>9.1f}" for c in conc))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return args.func(args)
    except TandemError as e:
        print(f"tandem: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
