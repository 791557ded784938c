"""`LLM`: the offline Python API (the vLLM shape).

    llm = LLM()                                        # default model, dtype auto
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0.0))
    outs[0].text, outs[0].token_ids, outs[0].finish_reason, outs[0].metrics
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Sequence

import torch

from tandem.config import CacheConfig, ModelConfig, RetentionConfig, SchedulerConfig, SpecConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.tokenizer import Tokenizer
from tandem.errors import ConfigError, InvalidRequestError
from tandem.kv import KVCacheManager
from tandem.models.fetch import resolve_model
from tandem.models.generation_config import default_sampling_params, generation_defaults
from tandem.models.loader import load_arch, load_model
from tandem.outputs import RequestOutput
from tandem.runner.attention import PagedKVCache
from tandem.runner.device import (available_memory_bytes, release_free_host_memory, resolve_block_size,
                                  resolve_device, resolve_dtype, resolve_kv_dtype)
from tandem.executor import TorchExecutor
from tandem.sampling_params import SamplingParams
from tandem.sched.build import build_scheduler
from tandem.sched.drafts import make_speculation
from tandem.sched.cost_model import StepCostModel
from tandem.engine.tool_runtime import ToolOptions, ToolRuntime
from tandem.tools.registry import ToolRegistry
from tandem.speculative.factory import make_spec_decoder
from tandem.structured import grammar as structured_grammar

log = logging.getLogger("tandem")


def build_engine(model_cfg: ModelConfig, cache_cfg: CacheConfig, sched_cfg: SchedulerConfig,
                 spec_cfg: SpecConfig | None = None, progress: bool = True,
                 tools: ToolRegistry | None = None) -> LLMEngine:
    """Load the model, size the KV cache, and wire scheduler, runner, speculation and tokenizer."""
    if model_cfg.num_threads:
        torch.set_num_threads(model_cfg.num_threads)
    device = resolve_device(model_cfg.device)
    dtype = resolve_dtype(model_cfg.dtype, device)
    model_dir = resolve_model(model_cfg.model, progress)
    arch = load_arch(model_dir)
    tokenizer = Tokenizer(model_dir)
    defaults = generation_defaults(model_cfg.generation_config, model_dir)
    if defaults:   # once at startup, as vLLM does
        log.warning("default sampling parameters overridden by %s: %s; relaunch with --generation-config vllm "
                    "(LLM(generation_config='vllm')) if this is not intended",
                    "the model's generation_config.json" if model_cfg.generation_config == "auto"
                    else model_cfg.generation_config, defaults)
    cache_cfg = dataclasses.replace(cache_cfg, block_size=resolve_block_size(cache_cfg.block_size, device))
    kv_dtype = resolve_kv_dtype(cache_cfg.kv_cache_dtype, dtype, device, _has_paged_kernel(device))
    bytes_per_block = PagedKVCache.bytes_per_block(arch.num_layers, cache_cfg.block_size, arch.num_kv_heads,
                                                   arch.head_dim, kv_dtype)
    context = model_cfg.max_model_len or _context_limit(arch.max_position_embeddings, arch.sliding_window)
    need = -(-sched_cfg.max_num_seqs * context // cache_cfg.block_size) * bytes_per_block
    num_blocks = cache_cfg.num_blocks or int(kv_cache_bytes(cache_cfg.kv_cache_memory_gb, device, need)
                                             // bytes_per_block)
    max_len = _max_model_len(model_cfg, arch.max_position_embeddings, arch.sliding_window,
                             num_blocks * cache_cfg.block_size)
    if model_cfg.load_format == "dummy":
        from tandem.models.dummy import load_dummy_model

        model, quant = load_dummy_model(model_dir, dtype, device, max_len, seed=model_cfg.seed), "dummy (random)"
    else:
        model, quant = load_weights(model_dir, dtype, device, max_len, model_cfg.quantization)
    if device.type == "cpu":
        release_free_host_memory()      # before the KV cache: the peak is weights plus cache
    sched_cfg = dataclasses.replace(sched_cfg, max_model_len=max_len)
    num_host = int(cache_cfg.swap_space_gb * 2**30 // bytes_per_block)
    kv = KVCacheManager(num_blocks, cache_cfg.block_size, cache_cfg.enable_prefix_caching, num_host_blocks=num_host)
    grammar = (structured_grammar.GrammarBackend(tokenizer.hf, arch.vocab_size, tokenizer.eos_token_ids)
               if structured_grammar.available() else None)
    runner = TorchExecutor(model, num_blocks, cache_cfg.block_size, device, seed=model_cfg.seed, num_host_blocks=num_host,
                         kv_dtype=kv_dtype, grammar=grammar)
    if spec_cfg is not None:
        def load_draft(path: str):
            ddir = resolve_model(path, progress)
            draft, how = load_weights(ddir, dtype, device, max_len, spec_cfg.draft_quantization)
            log.info("draft model %s: weights %s", ddir.name, how)
            return draft, Tokenizer(ddir)

        runner.set_speculation(make_spec_decoder(spec_cfg, runner, arch.vocab_size, tokenizer, load_draft))
    log.info("model %s: %s on %s, weights %s, %d KV blocks of %d tokens (%s), context %d, speculation %s",
             model_dir.name, dtype, device, quant, num_blocks, cache_cfg.block_size, kv_dtype, max_len, spec_cfg)
    # Seconds per token to copy KV to host and back (the min-waste rule's swap cost): per-token bytes
    # at a conservative 5 GB/s (PCIe on GPUs; a memcpy between tensors on CPUs).
    swap_s = bytes_per_block / cache_cfg.block_size / 5e9
    scheduler = build_scheduler(sched_cfg, kv, StepCostModel(), spec_cfg, swap_s_per_token=swap_s)
    runtime = ToolRuntime(tools, tokenizer) if tools is not None else None
    return LLMEngine(scheduler, runner, tokenizer, vocab_size=arch.vocab_size, max_model_len=max_len, tools=runtime,
                     grammar=grammar, generation_defaults=defaults, speculation=spec_cfg)


def reconfigure_speculation(engine: LLMEngine, cfg: SpecConfig | None, runner: TorchExecutor | None = None) -> None:
    """Switch a built engine's speculation to `cfg` (None: off), between runs (no request in it):
    the scheduler's draft-length side and the runner's decoder, both from `cfg`, as build_engine
    wires them. The running proposer (and draft worker) is kept when `cfg.method` is its method;
    an n-gram or layer-skip proposer is built otherwise (a separate draft model is loaded only
    with the engine). The benchmarks switch policies through this and nothing else. `runner`: the
    engine's TorchExecutor where a wrapper stands in as its executor (the calibration's recorder)."""
    runner = runner or engine.executor
    if not isinstance(runner, TorchExecutor):
        raise TypeError(f"reconfigure_speculation needs a TorchExecutor, not {type(runner).__name__}")
    if engine.has_unfinished_requests():
        raise RuntimeError("reconfigure_speculation while requests are in the engine")
    decoder = make_spec_decoder(cfg, runner, engine.vocab_size, engine.tokenizer, reuse=runner.spec) \
        if cfg is not None else None
    engine.scheduler.reconfigure_speculation(make_speculation(cfg, engine.scheduler.cost))
    runner.set_speculation(decoder)
    engine.speculation = cfg


KV_MIN_AUTO_BYTES = 2**29                   # an automatic KV cache gets at least 0.5 GiB (if needed)
KV_AUTO_FRACTION = {"cpu": 0.1, "cuda": 0.3}   # of the memory free before the model loads


def kv_cache_bytes(memory_gb: float | None, device: torch.device, need_bytes: int) -> int:
    """Bytes of KV cache: `memory_gb` when given; else (`None`, the default) a share of the memory
    free now (KV_AUTO_FRACTION, at least 0.5 GiB), but never more than `need_bytes`, what
    max_num_seqs requests at the full context would fill. vLLM sizes its cache from memory too
    (gpu_memory_utilization); a fixed small cache caps how many requests run at once, and so the
    batch a decode step amortizes its weight reads over (ShareGPT's 64 requests at once need ~30k
    tokens: 1.4 GB of float32 KV for the default model)."""
    if memory_gb is not None:
        return int(memory_gb * 2**30)
    share = KV_AUTO_FRACTION.get(device.type, KV_AUTO_FRACTION["cpu"]) * available_memory_bytes(device)
    return int(min(need_bytes, max(KV_MIN_AUTO_BYTES, share)))


def _has_paged_kernel(device: torch.device) -> bool:
    """True where Tandem's compiled paged-attention kernel runs (CPU, kernels built)."""
    if device.type != "cpu":
        return False
    from tandem.runner.kernels import load_cpu_kernels

    return load_cpu_kernels() is not None


# What quantization="auto" does with a model converted from a GGUF: llama.cpp's arithmetic, as
# llama.cpp and vLLM's GGUF kernels run such a file (Q4_1 layers take activations rounded to 8 bits
# per block); "gguf-float" keeps the float32 function. What each costs in perplexity, against float
# activations and against llama.cpp: docs/benchmarks.md, "Quantized weights".
AUTO_GGUF = "gguf"


def load_weights(model_dir, dtype: torch.dtype, device: torch.device, max_len: int, mode: str):
    """The model, and a description of its weights for the log. A model converted from a GGUF keeps
    its blocks (tandem.models.gguf_load) under "gguf" (llama.cpp's arithmetic: Q4_1 layers take x
    rounded to 8 bits per block) and "gguf-float" (float activations: the float32 function up to
    summation order), which insist; "auto" is AUTO_GGUF where it can be done, float weights
    elsewhere; "none" is float weights."""
    if mode == "none":
        return load_model(model_dir, dtype, device, max_positions=max_len), "float"
    from tandem.models.gguf_load import load_gguf_model
    from tandem.models.source import gguf_source
    from tandem.runner.kernels import make_ops

    source = gguf_source(model_dir)
    ops = make_ops(device)
    if source is None:
        why = "the model was not converted from a GGUF file"
    elif device.type != "cpu":
        why = "the quantized kernels run on CPU only"
    elif not hasattr(ops, "quant_linear"):
        why = "Tandem's CPU kernels could not be built"
    else:
        why = None
    if why is not None:
        if mode != "auto":
            raise ConfigError(f"quantization {mode!r}: {why}")
        return load_model(model_dir, dtype, device, max_positions=max_len), "float"
    activations = "int8" if (AUTO_GGUF if mode == "auto" else mode) == "gguf" else "float"
    return load_gguf_model(model_dir, source, dtype, max_len, ops, activations)


def _prompt_item(p: Any) -> tuple[str | None, list[int] | None]:
    """One prompt of `generate`: a string, or vLLM's dict forms {"prompt": text} (TextPrompt) and
    {"prompt_token_ids": [...]} (TokensPrompt)."""
    if isinstance(p, dict):
        unknown = set(p) - {"prompt", "prompt_token_ids"}
        if unknown or len(p) != 1:
            raise InvalidRequestError("a prompt dict holds exactly one of 'prompt' or 'prompt_token_ids'"
                                      + (f" (got {sorted(p)})" if p else ""), field="prompts")
        if "prompt_token_ids" in p:
            ids = p["prompt_token_ids"]
            if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
                raise InvalidRequestError("prompt_token_ids must be a list of token ids", field="prompt_token_ids")
            return None, list(ids)
        return p["prompt"], None
    return p, None


def as_spec_config(speculative: SpecConfig | str | dict | None) -> SpecConfig | None:
    """`speculative="ngram"` (or "layerskip") is shorthand for SpecConfig(method=...); a dict is
    vLLM's speculative_config (`SpecConfig.from_vllm`)."""
    if speculative is None or isinstance(speculative, SpecConfig):
        return speculative
    if isinstance(speculative, str):
        return SpecConfig(method=speculative)
    if isinstance(speculative, dict):
        return SpecConfig.from_vllm(speculative)
    raise ConfigError(f"speculative must be a SpecConfig, a method name or a vLLM speculative_config dict, "
                      f"got {speculative!r}")


def _context_limit(model_max: int, window: int | None) -> int:
    """The longest context the model supports (its positions, or its sliding window if shorter)."""
    return min(model_max, window or model_max)


def _max_model_len(cfg: ModelConfig, model_max: int, window: int | None, kv_tokens: int) -> int:
    limit = _context_limit(model_max, window)
    if cfg.max_model_len is not None:
        if cfg.max_model_len > limit:
            raise ConfigError(f"max_model_len {cfg.max_model_len} exceeds the model's context {limit}")
        if cfg.max_model_len > kv_tokens:
            raise ConfigError(f"max_model_len {cfg.max_model_len} does not fit the KV cache ({kv_tokens} tokens); "
                              "give more kv_cache_memory_gb")
        return cfg.max_model_len
    return min(limit, kv_tokens)


class LLM:
    def __init__(self, model: str | None = None, *, dtype: str = "auto", device: str = "auto",
                 max_model_len: int | None = None, max_num_batched_tokens: int = 512, max_num_seqs: int = 64,
                 kv_cache_memory_gb: float | None = None, num_kv_blocks: int | None = None, block_size: int | None = None,
                 enable_prefix_caching: bool = True, scheduling_policy: str = "fcfs", seed: int = 0,
                 num_threads: int | None = None, speculative: SpecConfig | str | None = None,
                 tools: ToolRegistry | list[str] | bool | None = None, swap_space_gb: float = 0.25,
                 progress: bool = True, quantization: str = "auto", generation_config: str = "auto",
                 target_tpot_ms: float | None = None,
                 ttft_guard_ms: float = 1000.0, kv_cache_dtype: str = "auto",
                 speculative_config: dict | None = None, session_retention: RetentionConfig | None = None,
                 load_format: str = "auto") -> None:
        if speculative_config is not None:          # vLLM's name for it
            if speculative is not None:
                raise ConfigError("give speculative or speculative_config, not both")
            speculative = SpecConfig.from_vllm(speculative_config)
        model_cfg = ModelConfig(model=model, dtype=dtype, device=device, max_model_len=max_model_len, seed=seed,
                                num_threads=num_threads, quantization=quantization,
                                generation_config=generation_config, load_format=load_format)
        cache_cfg = CacheConfig(block_size=block_size, kv_cache_memory_gb=kv_cache_memory_gb,
                                num_blocks=num_kv_blocks, enable_prefix_caching=enable_prefix_caching,
                                swap_space_gb=swap_space_gb, kv_cache_dtype=kv_cache_dtype)
        sched_cfg = SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                    policy=scheduling_policy, ttft_guard_s=ttft_guard_ms / 1000,
                                    target_tpot_s=target_tpot_ms / 1000 if target_tpot_ms else None,
                                    retention=session_retention or RetentionConfig())
        self.tool_registry = _as_registry(tools)
        self.engine = build_engine(model_cfg, cache_cfg, sched_cfg, as_spec_config(speculative), progress,
                                   self.tool_registry)
        self.tokenizer = self.engine.tokenizer

    def register_tool(self, fn, schema: dict | None = None, *, name: str | None = None,
                      timeout_s: float | None = None) -> None:
        """Make a Python callable available to `chat(..., tools=[...])` (tools run inside the engine)."""
        if self.engine.tools is None:
            raise ConfigError("this LLM was built without tools: pass tools=True (built-ins) or a ToolRegistry")
        self.tool_registry.register(fn, schema, name=name, timeout_s=timeout_s)

    def generate(self, prompts: str | Sequence[str] | None = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 prompt_token_ids: Sequence[Sequence[int]] | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        if prompts is not None and prompt_token_ids is not None:
            raise InvalidRequestError("give prompts or prompt_token_ids, not both", field="prompts")
        if prompt_token_ids is not None:
            items = [(None, list(ids)) for ids in prompt_token_ids]
        else:
            if prompts is None:
                raise InvalidRequestError("no prompts given", field="prompts")
            items = [_prompt_item(p) for p in ([prompts] if isinstance(prompts, (str, dict)) else prompts)]
        return self._run(items, sampling_params, use_tqdm)

    def chat(self, messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             tools: list[str] | None = None, max_tool_calls: int = 8, use_tqdm: bool = False) -> list[RequestOutput]:
        """Chat completions. `tools` names registered tools the model may call; they run inside the
        engine (the request pauses while a tool runs) and the output is the whole answer."""
        if not messages:
            raise InvalidRequestError("messages must be a non-empty list", field="messages")
        convs = [messages] if isinstance(messages[0], dict) else list(messages)
        options = None
        if tools:
            if self.engine.tools is None:
                raise InvalidRequestError("this LLM runs no tools: build it with tools=...", field="tools")
            unknown = [t for t in tools if t not in self.tool_registry]
            if unknown:
                raise InvalidRequestError(f"unknown tools {unknown}; registered: {self.tool_registry.names()}",
                                          field="tools")
            options = ToolOptions(names=list(tools), max_tool_calls=max_tool_calls)
        from tandem.tools.chat_format import render_chat

        schemas = self.tool_registry.schemas(list(tools)) if tools else None
        items = [(None, self.tokenizer.encode(render_chat(self.tokenizer.hf, c, schemas), add_special_tokens=False))
                 for c in convs]
        return self._run(items, sampling_params, use_tqdm, options)

    def _run(self, items: list[tuple[str | None, list[int] | None]], sampling_params, use_tqdm: bool,
             tool_options: ToolOptions | None = None) -> list[RequestOutput]:
        params = [dataclasses.replace(p, output_kind="final_only")      # only the finished outputs are read
                  for p in _per_request(sampling_params, len(items), self.engine.generation_defaults)]
        # validate (and tokenize) everything once, before queueing anything
        valid = [self.engine.validate(prompt, ids, p) for (prompt, ids), p in zip(items, params)]
        order = [self.engine.add_valid(v, tool_options=tool_options) for v in valid]
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(order), desc="generating", unit="req")
        try:
            while self.engine.has_unfinished_requests():
                outs = self.engine.step()
                if not outs and not self.engine.scheduler.has_work():
                    self.engine.wait_for_tools()        # only paused requests: wait for a tool, not spin
                for out in outs:
                    if out.finished:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for rid in order:            # leave the engine usable after an interrupt
                if rid not in done:
                    self.engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[rid] for rid in order]


def _as_registry(tools) -> ToolRegistry | None:
    """tools=True: the built-ins; a list of names: those built-ins; a ToolRegistry: as is."""
    if tools is None or tools is False:
        return None
    if isinstance(tools, ToolRegistry):
        return tools
    reg = ToolRegistry.with_builtins()
    if tools is True:
        return reg
    unknown = [t for t in tools if t not in reg]
    if unknown:
        raise ConfigError(f"unknown built-in tools {unknown}; built-ins: {reg.names()}")
    keep = ToolRegistry(reg.default_timeout_s)
    for name in tools:
        t = reg.get(name)
        keep.register(t.fn, t.schema, name=name, timeout_s=t.timeout_s)
    return keep


def _per_request(sampling_params, n: int, defaults: dict | None = None) -> list[SamplingParams]:
    """One SamplingParams per prompt; none given: the model's defaults (its generation_config.json)."""
    if sampling_params is None:
        return [default_sampling_params(defaults or {})] * n
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    params = list(sampling_params)
    if len(params) != n:
        raise InvalidRequestError(f"{len(params)} sampling params for {n} prompts", field="sampling_params")
    return params
