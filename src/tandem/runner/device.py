"""Device and dtype choice. `auto` picks what is fast on the hardware at hand."""

from __future__ import annotations

import torch

from tandem.errors import ConfigError

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
           "half": torch.float16, "float32": torch.float32, "fp32": torch.float32, "float": torch.float32}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError as e:
        raise ConfigError(f"unknown device {name!r}") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' asked for, but CUDA is not available")
    return dev


def cpu_info() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo ("model name", "flags", ...); {} where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            first = f.read().split("\n\n")[0]
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in first.splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def available_memory_bytes(device: torch.device) -> int:
    """Memory free for new tensors on `device`: MemAvailable of /proc/meminfo on CPU (0 where there
    is none), the device's free memory on CUDA."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def release_free_host_memory() -> None:
    """Give the memory that loading freed back to the system: collect Python's garbage, then ask
    glibc's allocator to return its free pages (malloc_trim; its heap keeps them otherwise, and
    they count towards the process's resident memory). Called once the weights are loaded and
    before the KV cache is allocated, so that the process's peak is weights plus cache, not
    weights plus the loader's leftovers plus cache. A no-op where the C library is not glibc."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def cpu_has_fast_bf16() -> bool:
    """True if this CPU computes bf16 matmuls natively (AVX512-BF16 or AMX); else bf16 is emulated and slow.

    Asks torch where it still says (older releases had `torch._C._cpu._is_avx512_bf16_supported`;
    2.13 has neither that nor the AMX check), else the CPU's own flags."""
    cpu = getattr(torch._C, "_cpu", None)
    for check in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"):
        fn = getattr(cpu, check, None)
        if fn is not None and fn():
            return True
    return bool({"avx512_bf16", "amx_bf16"} & set(cpu_info().get("flags", "").split()))


def resolve_kv_dtype(name: str, model_dtype: torch.dtype, device: torch.device, fused_kernel: bool) -> torch.dtype:
    """The KV cache's dtype. `auto`: the model's dtype, except float16 under a float32 model on a
    CPU whose compiled paged-attention kernel reads float16 (F16C, every AVX2 CPU): decode attention
    over long contexts is bound by the bytes of K/V it reads, and a float16 cache halves them (and
    holds twice the tokens). llama.cpp's cache is float16 by default too. K and V are rounded to
    float16 when stored (a relative error of at most 2^-11); the attention math stays float32.
    `float32` keeps a float32 model exact."""
    if name == "auto":
        if device.type == "cpu" and model_dtype == torch.float32 and fused_kernel and cpu_has_f16c():
            return torch.float16
        return model_dtype
    if name not in _DTYPES:
        raise ConfigError(f"unknown kv_cache_dtype {name!r}; use auto, {', '.join(_DTYPES)}")
    kv = _DTYPES[name]
    if kv != model_dtype and model_dtype != torch.float32:
        raise ConfigError(f"kv_cache_dtype {name} needs a float32 model or the model's own dtype "
                          f"({str(model_dtype).removeprefix('torch.')})")
    return kv


CPU_BLOCK_SIZE = 128       # vLLM's CPU default too
GPU_BLOCK_SIZE = 16


def resolve_block_size(block_size: int | None, device: torch.device) -> int:
    """Tokens per KV block. None (auto): 128 on CPU, 16 elsewhere. A block holds one KV head's keys
    (and values) contiguously, and CPU decode attention streams them from memory once a batch's
    cache outgrows the last-level cache: longer runs per block read faster (docs/engine.md, "Why the
    defaults are what they are"). The price is a
    coarser prefix cache (hits count whole blocks) and up to a block of unused slots per sequence.
    vLLM's CPU backend defaults to 128 as well; its GPU kernels and Tandem's CUDA path use 16."""
    if block_size is not None:
        return block_size
    return CPU_BLOCK_SIZE if device.type == "cpu" else GPU_BLOCK_SIZE


def cpu_has_f16c() -> bool:
    return "f16c" in cpu_info().get("flags", "").split()


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto`: bf16 on CUDA and on CPUs with native bf16, float32 on other CPUs (where bf16 runs
    far slower than float32 because every product is converted in software; docs/benchmarks.md)."""
    if name != "auto":
        if name not in _DTYPES:
            raise ConfigError(f"unknown dtype {name!r}; use auto, {', '.join(_DTYPES)}")
        return _DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
