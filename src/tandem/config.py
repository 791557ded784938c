"""Small frozen configurations, one per component; no I/O here."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.errors import ConfigError


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 512   # token budget of one step (prefill chunks + decodes)
    max_num_seqs: int = 64              # requests running at once
    max_model_len: int = 2048           # context limit (prompt + output)
    policy: str = "fcfs"
    enable_chunked_prefill: bool = True
    watermark: float = 0.01             # fraction of KV blocks kept free when admitting new requests

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError("without chunked prefill, max_num_batched_tokens must be >= max_model_len")
        if not 0.0 <= self.watermark < 1.0:
            raise ConfigError(f"watermark must be in [0, 1), got {self.watermark}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory_gb: float = 0.5     # used when num_blocks is not given
    num_blocks: int | None = None
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.num_blocks is None and self.kv_cache_memory_gb <= 0:
            raise ConfigError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None            # HF directory, .gguf file, or None for the default model
    dtype: str = "auto"                 # auto | bfloat16 | float16 | float32
    device: str = "auto"                # auto | cpu | cuda[:N]
    max_model_len: int | None = None    # None: the model's own context length (capped, see engine)
    seed: int = 0
    num_threads: int | None = None      # CPU threads for torch (None: all cores)

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "bfloat16", "bf16", "float16", "fp16", "half", "float32", "fp32", "float"):
            raise ConfigError(f"unknown dtype {self.dtype!r} (auto, bfloat16, float16 or float32)")
