"""Small frozen configurations, one per component; no I/O here."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tandem.errors import ConfigError

# Weight modes (tandem.llm.load_weights): auto, llama.cpp's GGUF arithmetic, GGUF blocks with
# float activations, float weights only.
QUANTIZATIONS = ("auto", "gguf", "gguf-float", "none")
LOAD_FORMATS = ("auto", "dummy")
# The scheduling policies tandem.sched.policies builds by name (its docstring says what each does).
POLICY_NAMES = ("fcfs", "fcfs-discard", "infercept", "augserve-stage1", "augserve-stage2", "augserve", "continuum")


@dataclass(frozen=True)
class RetentionConfig:
    """Bounds on KV held for sessions between their calls (tandem.sched.retention)."""
    max_hold_s: float = 600.0                 # a held context is freed after this long
    max_share: float = 0.5                    # of device KV blocks, held for waiting sessions at most
    max_blocks_per_owner: int | None = None   # device + host blocks one owner's sessions may hold

    def __post_init__(self) -> None:
        if self.max_hold_s <= 0:
            raise ConfigError(f"max_hold_s must be > 0, got {self.max_hold_s}")
        if not 0.0 <= self.max_share <= 1.0:
            raise ConfigError(f"max_share must be in [0, 1], got {self.max_share}")
        if self.max_blocks_per_owner is not None and self.max_blocks_per_owner < 0:
            raise ConfigError(f"max_blocks_per_owner must be >= 0, got {self.max_blocks_per_owner}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 512   # token budget of one step (prefill chunks + decodes)
    max_num_seqs: int = 64              # requests running at once
    max_model_len: int = 2048           # context limit (prompt + output)
    policy: str = "fcfs"                # fcfs | fcfs-discard | infercept | augserve[-stage1|-stage2]
    enable_chunked_prefill: bool = True
    watermark: float = 0.01             # fraction of KV blocks kept free when admitting new requests
    target_tpot_s: float | None = None  # hold running requests' mean TPOT to this (sched.budget.TpotGuard)
    ttft_guard_s: float = 1.0           # ... unless a prompt has waited this long for its first token
    retention: RetentionConfig = RetentionConfig()   # KV held for sessions between calls

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError("without chunked prefill, max_num_batched_tokens must be >= max_model_len")
        if self.target_tpot_s is not None and self.target_tpot_s <= 0:
            raise ConfigError(f"target_tpot_s must be > 0, got {self.target_tpot_s}")
        if self.ttft_guard_s <= 0:
            raise ConfigError(f"ttft_guard_s must be > 0, got {self.ttft_guard_s}")
        if not 0.0 <= self.watermark < 1.0:
            raise ConfigError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.policy not in POLICY_NAMES:
            raise ConfigError(f"unknown scheduling policy {self.policy!r}; known: {', '.join(POLICY_NAMES)}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int | None = None       # tokens per KV block; None: runner.device.resolve_block_size (128 on CPU, 16 on GPU)
    kv_cache_memory_gb: float | None = None   # None: sized from free memory (see tandem.llm.kv_cache_bytes)
    num_blocks: int | None = None
    enable_prefix_caching: bool = True
    swap_space_gb: float = 0.25         # host memory for KV swapped out during tool pauses
    kv_cache_dtype: str = "auto"        # auto | float32 | bfloat16 | float16 (see runner.device.resolve_kv_dtype)

    def __post_init__(self) -> None:
        if self.swap_space_gb < 0:
            raise ConfigError(f"swap_space_gb must be >= 0, got {self.swap_space_gb}")
        if self.block_size is not None and (self.block_size < 1 or self.block_size & (self.block_size - 1)):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.num_blocks is None and self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb <= 0:
            raise ConfigError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None            # HF directory, .gguf file, Hub id org/name[@rev], or None: the default
    dtype: str = "auto"                 # auto | bfloat16 | float16 | float32
    device: str = "auto"                # auto | cpu | cuda[:N]
    max_model_len: int | None = None    # None: the model's own context length (capped, see engine)
    seed: int = 0
    num_threads: int | None = None      # CPU threads for torch (None: all cores)
    # QUANTIZATIONS: gguf keeps a GGUF model's Q4_1 / Q8_0 blocks on CPU with llama.cpp's arithmetic
    # (Q4_1 layers take activations rounded to 8 bits per block), gguf-float keeps them with float
    # activations (the float32 function), both an error where they cannot; auto is gguf where it can
    # be, float weights elsewhere; none is float weights only (tandem.llm.load_weights).
    quantization: str = "auto"
    # Sampling defaults for requests that omit a field: auto: the model's generation_config.json;
    # vllm: none (neutral); else a folder holding a generation_config.json (tandem.models.generation_config).
    generation_config: str = "auto"
    # LOAD_FORMATS: auto reads the weights; dummy draws random ones from config.json alone (vLLM's
    # --load-format dummy; tandem.models.dummy), to measure a shape without its weights.
    load_format: str = "auto"

    def __post_init__(self) -> None:
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(f"unknown load_format {self.load_format!r} ({', '.join(LOAD_FORMATS)})")
        if self.load_format == "dummy" and self.quantization not in ("auto", "none"):
            raise ConfigError(f"load_format 'dummy' draws float weights; quantization {self.quantization!r} "
                              "needs a GGUF model (write one with `tandem model dummy`)")
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"unknown quantization {self.quantization!r} ({', '.join(QUANTIZATIONS)})")
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ConfigError(f"generation_config must be auto, vllm or a folder, got {self.generation_config!r}")
        if self.dtype not in ("auto", "bfloat16", "bf16", "float16", "fp16", "half", "float32", "fp32", "float"):
            raise ConfigError(f"unknown dtype {self.dtype!r} (auto, bfloat16, float16 or float32)")


SPEC_METHODS = ("ngram", "suffix", "draft", "layerskip")
SPEC_POLICIES = ("adaptive", "fixed", "table", "survival", "none")
RUN_AHEAD = ("off", "auto", "always")


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding (FASER). `policy` chooses each request's draft length every step:

    - adaptive: maximise expected accepted tokens per second from each request's per-position
      acceptance history and a step-cost model learned from the engine's own step times (FASER);
    - fixed: `max_draft_tokens` for every request that has drafts;
    - table: a decode-batch-size -> length table (vLLM's "dynamic SD"), `length_table`;
    - survival: vLLM's adaptive verification: (request, position) slots admitted by survival
      probability (running product of per-position acceptance EMAs) while the step-cost model says
      the marginal slot pays;
    - none: proposer wired in but never used (for A/B runs).

    `run_ahead` (the simulator's executor only, for now): while a step verifies, draft the next
    step's tokens on the guess that every draft and the bonus token hold ("auto": where the
    scheduler's cost model expects it to pay, from acceptance and load; "always": every step).
    """

    method: str = "ngram"
    max_draft_tokens: int | None = None  # most drafts per step (default 8; suffix: its tree depth, as vLLM)
    policy: str = "adaptive"
    ngram_min: int = 1                  # n-gram sizes tried, longest first
    ngram_max: int = 4
    # method="suffix" (vLLM's names and defaults): match + draft length, FIFO cache of earlier
    # outputs (0: none), draft <= factor x match length, least estimated chance of a drafted token
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    suffix_decoding_max_cached_tokens: int = 1 << 20    # Tandem's own bound on that cache, in tokens
    draft_model: str | None = None      # method="draft": HF dir or GGUF sharing the target's tokenizer
    draft_quantization: str = "auto"    # the draft model's weights (QUANTIZATIONS; vLLM's "quantization")
    num_draft_layers: int | None = None  # method="layerskip": the target's first L layers (default: 1/4)
    length_table: tuple[tuple[int, int], ...] = ((1, 8), (2, 6), (4, 4), (8, 3), (16, 2), (32, 1))
    frontier_size: int = 0              # verify drafts in chunks of this many (0: all at once)
    adaptive_frontiers: bool = False    # the scheduler picks, per step, frontiers of frontier_size or one pass
    early_exit_layer: int | None = None  # layer at which predicted-rejected draft suffixes are dropped
    early_exit_topk: int = 8            # the check: is the draft token among the top-k at that layer?
    overlap: bool = False               # draft frontier f+1 while frontier f is verified (model drafters)
    draft_threads: int = 1              # CPU threads the overlapped drafter gets (the verifier keeps the rest)
    run_ahead: str = "off"              # off | auto | always: draft step t+1 while step t verifies

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ConfigError(f"speculative method must be one of {SPEC_METHODS}, got {self.method!r}")
        if self.max_draft_tokens is None:
            object.__setattr__(self, "max_draft_tokens", min(32, self.suffix_decoding_max_tree_depth)
                               if self.method == "suffix" else 8)
        if self.policy not in SPEC_POLICIES:
            raise ConfigError(f"speculative policy must be one of {SPEC_POLICIES}, got {self.policy!r}")
        if not 1 <= self.max_draft_tokens <= 32:
            raise ConfigError(f"max_draft_tokens must be in [1, 32], got {self.max_draft_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ConfigError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")
        if self.method == "draft" and not self.draft_model:
            raise ConfigError("speculative method 'draft' needs draft_model")
        if self.draft_quantization not in QUANTIZATIONS:
            raise ConfigError(f"unknown draft_quantization {self.draft_quantization!r} ({', '.join(QUANTIZATIONS)})")
        if self.num_draft_layers is not None and self.num_draft_layers < 1:
            raise ConfigError(f"num_draft_layers must be >= 1, got {self.num_draft_layers}")
        if self.frontier_size < 0:
            raise ConfigError(f"frontier_size must be >= 0, got {self.frontier_size}")
        if self.early_exit_layer is not None and self.early_exit_layer < 1:
            raise ConfigError(f"early_exit_layer must be >= 1, got {self.early_exit_layer}")
        if self.early_exit_topk < 1:
            raise ConfigError(f"early_exit_topk must be >= 1, got {self.early_exit_topk}")
        if self.draft_threads < 1:
            raise ConfigError(f"draft_threads must be >= 1, got {self.draft_threads}")
        if self.suffix_decoding_max_tree_depth < 2:
            raise ConfigError("suffix_decoding_max_tree_depth must be >= 2 (a match and a draft token), "
                              f"got {self.suffix_decoding_max_tree_depth}")
        if self.suffix_decoding_max_cached_requests < 0 or self.suffix_decoding_max_cached_tokens < 2:
            raise ConfigError("suffix_decoding_max_cached_requests must be >= 0 and "
                              "suffix_decoding_max_cached_tokens >= 2")
        if self.suffix_decoding_max_spec_factor < 0:
            raise ConfigError(f"suffix_decoding_max_spec_factor must be >= 0, got "
                              f"{self.suffix_decoding_max_spec_factor}")
        if not 0 <= self.suffix_decoding_min_token_prob <= 1:
            raise ConfigError(f"suffix_decoding_min_token_prob must be in [0, 1], got "
                              f"{self.suffix_decoding_min_token_prob}")
        if self.overlap and self.method in ("ngram", "suffix"):
            raise ConfigError("overlap needs a model drafter (method 'draft' or 'layerskip'): "
                              f"{self.method} drafting is a lookup, there is no drafting compute to overlap")
        if self.adaptive_frontiers and self.frontier_size < 1:
            raise ConfigError("adaptive_frontiers chooses per step between frontiers of frontier_size and "
                              "one pass: set frontier_size >= 1")
        if self.overlap and self.frontier_size < 1:
            raise ConfigError("overlap drafts frontier f+1 while frontier f is verified: set frontier_size >= 1")
        if self.run_ahead not in RUN_AHEAD:
            raise ConfigError(f"run_ahead must be one of {RUN_AHEAD}, got {self.run_ahead!r}")
        if self.run_ahead != "off" and (self.policy != "adaptive" or self.frontier_size):
            raise ConfigError("run_ahead needs the adaptive length policy and verification in one pass "
                              "(frontier_size 0): it drafts the next step's lengths the policy chooses")
        if any(b < 1 or k < 0 for b, k in self.length_table):
            raise ConfigError("length_table entries must be (batch size >= 1, length >= 0)")

    @classmethod
    def from_vllm(cls, spec: dict | str) -> SpecConfig:
        """A SpecConfig from vLLM's `--speculative-config` JSON (a dict or its text): `method`
        ngram, suffix or draft_model (or a `model` alone), `num_speculative_tokens` (the most drafted
        per step), `prompt_lookup_min` / `prompt_lookup_max`, the `suffix_decoding_*` options; any SpecConfig field by its own name
        (`policy`, `frontier_size`, ...) may sit beside them. `policy` stays adaptive unless given:
        `"policy": "fixed"` drafts vLLM's fixed length."""
        import json

        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except ValueError as e:
                raise ConfigError(f"speculative config is not JSON: {e}") from None
        if not isinstance(spec, dict):
            raise ConfigError(f"speculative config must be a JSON object, got {type(spec).__name__}")
        renames = {"num_speculative_tokens": "max_draft_tokens", "prompt_lookup_min": "ngram_min",
                   "prompt_lookup_max": "ngram_max", "model": "draft_model",
                   "quantization": "draft_quantization"}
        spec = dict(spec)
        method = spec.pop("method", None)
        if method == "draft_model" or (method is None and (spec.get("model") or spec.get("draft_model"))):
            method = "draft"
        if method not in (None, *SPEC_METHODS):
            raise ConfigError(f"speculative method {method!r} is not supported; use ngram, suffix, draft_model "
                              "(with model) or layerskip")
        kw: dict = {"method": method or "ngram"}
        known = {f.name for f in dataclasses.fields(cls)} - {"method"}
        for key, value in spec.items():
            name = renames.get(key, key)
            if name not in known:
                raise ConfigError(f"unknown speculative config key {key!r}; known: {sorted(set(renames) | known)}")
            if value is not None:
                kw[name] = tuple(map(tuple, value)) if name == "length_table" else value
        if "ngram_min" in kw and "ngram_max" not in kw:      # vLLM: min alone raises the max to it
            kw["ngram_max"] = max(kw["ngram_min"], cls.ngram_max)
        try:
            return cls(**kw)
        except TypeError as e:                # e.g. "4" where a number belongs
            raise ConfigError(f"speculative config: wrong value type ({e})") from None
