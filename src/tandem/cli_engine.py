"""The engine's command-line arguments and the LLM they build, shared by `tandem` (tandem.cli) and
the Ray Serve replicas (tandem.cluster), which build their engines exactly as `tandem serve` does;
kept below both so neither imports the other."""

from __future__ import annotations

import argparse

from tandem.cli_serve import add_serve_arguments
from tandem.config import LOAD_FORMATS, QUANTIZATIONS
from tandem.models.shapes import SHAPES


SERVE_BATCHED_TOKENS = 2048   # `tandem serve`'s step budget, vLLM's server default (docs/benchmarks.md)


def add_model_args(p: argparse.ArgumentParser, max_num_batched_tokens: int = 512, block_size: int | None = None) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="HF model directory, .gguf file, or Hugging Face Hub repository org/name[@revision] "
                        "(org/name/FILE.gguf for one GGUF of a repository; fetched into the HF cache, "
                        "HF_HUB_OFFLINE=1 reads the cache only), or a shape for --load-format dummy "
                        "(default: SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="auto", help="auto | bfloat16 | float16 | float32 (auto: bf16 where fast)")
    g.add_argument("--device", default="auto")
    g.add_argument("--quantization", choices=QUANTIZATIONS, default="auto",
                   help="a model from a GGUF keeps its Q4_1/Q8_0 blocks on CPU: gguf = llama.cpp's arithmetic "
                        "(Q4_1 layers take activations rounded to 8 bits per block), gguf-float = float "
                        "activations (the float32 function); auto = gguf for a model from a GGUF; none = float weights only")
    g.add_argument("--load-format", choices=LOAD_FORMATS, default="auto",
                   help="dummy: random weights from the model's config.json alone, as vLLM's, to measure a "
                        f"shape without its weights (shipped shapes: {', '.join(SHAPES)})")
    g.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                   help="sampling defaults for requests that omit a field: auto, the model's "
                        "generation_config.json (temperature, top_p, top_k, min_p, penalties, max_new_tokens); "
                        "vllm, none (neutral); or a folder holding a generation_config.json (default auto)")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=max_num_batched_tokens,
                   help=f"tokens one step computes, prefill chunks and decodes (default {max_num_batched_tokens})")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--target-tpot-ms", type=float, default=None,
                   help="hold running requests' mean time per output token to this while prompts are "
                        "prefilled, by lowering the step's token budget (default: off)")
    g.add_argument("--ttft-guard-ms", type=float, default=1000.0,
                   help="... except once a prompt has waited this long for its first token")
    g.add_argument("--kv-cache-memory-gb", type=float, default=None,
                   help="KV cache size (default: a tenth of free memory, at most what --max-num-seqs full "
                        "contexts need)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: the model's dtype, but float16 under a float32 model on CPU (half the bytes "
                        "decode attention reads; llama.cpp's default); float32 keeps a float32 model exact")
    g.add_argument("--block-size", type=int, default=block_size,
                   help="tokens per KV block, a power of two (default: " + (
                       str(block_size) if block_size else "128 on CPU, where decode attention streams longer "
                       "runs of K/V faster, as vLLM's CPU backend; 16 on GPU") + ")")
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--scheduling-policy", default="fcfs",
                   help="fcfs | fcfs-discard | infercept | augserve | augserve-stage1 | augserve-stage2 | continuum")
    g.add_argument("--swap-space-gb", type=float, default=0.25, help="host memory for KV swapped out in tool pauses")
    g.add_argument("--session-max-hold-s", type=float, default=600.0,
                   help="a session's held KV (x-session-id / user) is freed after this long (default 600)")
    g.add_argument("--session-max-share", type=float, default=0.5,
                   help="share of the device KV cache held for waiting sessions at most (default 0.5)")
    g.add_argument("--session-max-blocks-per-key", type=int, default=None,
                   help="KV blocks (device + host) one API key's sessions may hold (default: no cap)")
    sd = p.add_argument_group("speculative decoding (FASER)")
    sd.add_argument("--speculative", choices=["ngram", "suffix", "draft", "layerskip"], default=None)
    sd.add_argument("--speculative-config", default=None, metavar="JSON",
                    help='vLLM\'s form, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' or '
                         '\'{"model": "draft.gguf", "num_speculative_tokens": 5}\'; Tandem\'s SpecConfig '
                         'fields (policy, frontier_size, ...) may sit beside them')
    sd.add_argument("--spec-policy", choices=["adaptive", "fixed", "table", "survival", "none"], default="adaptive")
    sd.add_argument("--max-draft-tokens", type=int, default=None,
                    help="most drafts per step (default 8; suffix: 24, its tree depth)")
    sd.add_argument("--draft-model", default=None, help="draft model (HF dir or .gguf) for --speculative draft")
    sd.add_argument("--draft-quantization", choices=QUANTIZATIONS, default="auto",
                    help="the draft model's weights, as --quantization (auto: a GGUF draft stays quantized). "
                         "A float target (--quantization none) drafted by its own GGUF is exact and faster")
    sd.add_argument("--num-draft-layers", type=int, default=None, help="layers of the target used by layerskip")
    sd.add_argument("--frontier-size", type=int, default=0, help="verify drafts in chunks of this many (0: off)")
    sd.add_argument("--early-exit-layer", type=int, default=None, help="prune predicted-rejected drafts here")
    sd.add_argument("--adaptive-frontiers", action="store_true",
                    help="the scheduler chooses, each step, frontiers of --frontier-size or one pass")
    sd.add_argument("--overlap", action="store_true",
                    help="draft frontier f+1 on another thread while frontier f is verified (needs --frontier-size)")
    sd.add_argument("--draft-threads", type=int, default=1, help="CPU threads the overlapped drafter gets")


def tool_registry_from_args(a: argparse.Namespace):
    """--tools calculator,retrieve (built-ins) and/or --tools-module my.module (its `register(registry)`)."""
    names = [t for t in (getattr(a, "tools", None) or "").split(",") if t]
    module = getattr(a, "tools_module", None)
    if not names and not module:
        return None
    import importlib

    from tandem.errors import ConfigError
    from tandem.tools.registry import ToolRegistry

    builtins = ToolRegistry.with_builtins(docs_dir=getattr(a, "tools_docs", None))
    reg = ToolRegistry()
    for n in names:
        t = builtins.get(n)
        if t is None:
            raise ConfigError(f"unknown built-in tool {n!r}; built-ins: {builtins.names()}")
        reg.register(t.fn, t.schema, name=n, timeout_s=t.timeout_s)
    if module:
        importlib.import_module(module).register(reg)
    return reg


def spec_config_from_args(a: argparse.Namespace):
    from tandem.config import SpecConfig
    from tandem.errors import ConfigError

    if getattr(a, "speculative_config", None):
        if getattr(a, "speculative", None):
            raise ConfigError("give --speculative or --speculative-config, not both")
        return SpecConfig.from_vllm(a.speculative_config)
    if not getattr(a, "speculative", None):
        return None

    return SpecConfig(method=a.speculative, policy=a.spec_policy, max_draft_tokens=a.max_draft_tokens,
                      draft_model=a.draft_model, draft_quantization=a.draft_quantization,
                      num_draft_layers=a.num_draft_layers,
                      frontier_size=a.frontier_size, early_exit_layer=a.early_exit_layer,
                      overlap=a.overlap, draft_threads=a.draft_threads,
                      adaptive_frontiers=a.adaptive_frontiers)


def make_llm(a: argparse.Namespace, **overrides):
    from tandem.config import RetentionConfig
    from tandem.llm import LLM

    kw = dict(model=a.model, dtype=a.dtype, device=a.device, max_model_len=a.max_model_len,
              max_num_batched_tokens=a.max_num_batched_tokens, max_num_seqs=a.max_num_seqs,
              kv_cache_memory_gb=a.kv_cache_memory_gb, block_size=a.block_size,
              enable_prefix_caching=not a.no_prefix_caching,
              seed=a.seed, speculative=spec_config_from_args(a), scheduling_policy=a.scheduling_policy,
              swap_space_gb=a.swap_space_gb, tools=tool_registry_from_args(a), quantization=a.quantization,
              generation_config=a.generation_config, load_format=a.load_format,
              target_tpot_ms=a.target_tpot_ms, ttft_guard_ms=a.ttft_guard_ms, kv_cache_dtype=a.kv_cache_dtype,
              session_retention=RetentionConfig(a.session_max_hold_s, a.session_max_share,
                                                a.session_max_blocks_per_key))
    kw.update(overrides)
    return LLM(**kw)


def served_model_name(model: str | None) -> str:
    """The default name a server answers to: the model directory's name (a GGUF file's stem); for a
    Hugging Face Hub model, its repository id org/name (as vLLM, without the @revision)."""
    from pathlib import Path

    from tandem.models.fetch import DEFAULT_MODEL, parse_hub_id

    if model is None:
        return DEFAULT_MODEL
    path = Path(model).expanduser()
    hub = None if path.exists() else parse_hub_id(model)
    if hub is not None:
        return hub[0]
    return path.stem if path.suffix == ".gguf" else path.resolve().name


def serve_parser() -> argparse.ArgumentParser:
    """A parser of `tandem serve`'s flags alone (its own and the engine's)."""
    p = argparse.ArgumentParser(prog="tandem serve")
    add_serve_arguments(p)
    add_model_args(p, SERVE_BATCHED_TOKENS)
    return p
