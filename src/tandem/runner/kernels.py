"""Per-layer small ops, in two implementations with one interface.

`TorchOps` is plain PyTorch and runs on any device. `CpuKernelOps` calls Tandem's fused C++
kernels (csrc/: one file per kernel topic, each registering its own ops; csrc/cpu_ops.cpp is the
module's entry point), compiled on first use with torch's cpp_extension and cached under
$TANDEM_CACHE/ext; if compilation is impossible the engine falls back to `TorchOps` with a
warning. Set TANDEM_CPU_KERNELS=0 to force the fallback.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

log = logging.getLogger("tandem.kernels")
_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / name for name in (
    "cpu_ops.cpp",            # the module's entry point: the register_* calls of the files below
    "elementwise.cpp",        # add_rms_norm, rope_, silu_and_mul
    "paged_attention.cpp",    # paged_attention (float32 / bfloat16 / float16 caches; AVX512-BF16 items:
                              # paged_attention_bf16.h), decode_bf16_available
    "kv_write.cpp",           # kv_write_
    "quant_linear.cpp",       # quant_linear, quant_dequantize (GGML blocks, float32 activations)
    "packed_linear.cpp",      # pack_linear, packed_linear (float32 on 16-column panels)
    "linear_bf16.cpp",        # pack_linear_bf16, packed_linear_bf16 (AVX512-BF16)
    "quant_bf16.cpp",         # quant_pack_bf16, quant_linear_bf16 (AVX512-BF16)
    "quant_i8.cpp",           # quant_pack_i8, quant_linear_i8(_parts) (8-bit activations; K-quants: quant_i8_kquant.h)
    "prefill_bf16.cpp",       # prefill_attention_bf16 (AVX512-BF16)
    "sampling.cpp",           # sample_rows
    "grammar_mask.cpp",       # mask_by_bits_
    "decoder_stack.cpp",      # DecoderStack
)]
# helpers shared by several sources, and the 8-bit kernel's parts: part of the build's key
_HEADERS = [_CSRC / name for name in ("common.h", "amx.h", "paged_attention.h", "paged_attention_bf16.h", "quant_i8.h",
                                       "quant_i8_kquant.h")]
_module: ModuleType | None = None
_tried = False


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class TorchOps:
    name = "torch"

    @staticmethod
    def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, w: torch.Tensor, eps: float) -> torch.Tensor:
        """x += delta (in place, if given); returns rms_norm(x) * w."""
        if delta is not None:
            x.add_(delta)
        return F.rms_norm(x, (x.shape[-1],), w, eps)

    @staticmethod
    def rope_(x: torch.Tensor, num_heads: int, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> None:
        """In-place rotate-half RoPE on heads [0, num_heads) of x: [N, heads, D]; cos/sin: [P, D] tables."""
        c = cos[positions].unsqueeze(1)
        s = sin[positions].unsqueeze(1)
        r = x[:, :num_heads]
        r.copy_(r * c + rotate_half(r) * s)

    @staticmethod
    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class CpuKernelOps:
    name = "cpu-kernels"

    def __init__(self, module: ModuleType) -> None:
        self.m = module
        self._prefill_bf16 = module.prefill_bf16_available()    # asked once, not per layer and step

    def add_rms_norm(self, x, delta, w, eps):
        return self.m.add_rms_norm(x, delta, w, eps)

    def rope_(self, x, num_heads, cos, sin, positions):
        self.m.rope_(x, num_heads, cos, sin, positions)

    def silu_and_mul(self, x):
        return self.m.silu_and_mul(x)

    def quant_linear(self, x, w, bias, qtype: int):
        return self.m.quant_linear(x, w, bias, qtype)

    def bf16_linear_available(self) -> bool:
        return self.m.bf16_linear_available()

    def quant_pack_bf16(self, data, qtype: int, n: int, k: int):
        return self.m.quant_pack_bf16(data, qtype, n, k)

    def quant_linear_bf16(self, x, w, bias, qtype: int, n: int):
        return self.m.quant_linear_bf16(x, w, bias, qtype, n)

    def i8_linear_available(self) -> bool:
        return self.m.i8_linear_available()

    def quant_pack_i8(self, data, n: int, k: int, qtype: int):
        return self.m.quant_pack_i8(data, n, k, qtype)

    def quant_linear_i8(self, x, w, bias, n: int, qtype: int):
        """x float32 [..., K] (made contiguous if it is not), bias float32 or None."""
        return self.m.quant_linear_i8(x, w, bias, n, qtype)

    def quant_linear_i8_parts(self, x, w, bias, parts: tuple[tuple[int, int], ...]):
        """quant_linear_i8 over a fused layer whose parts' record types differ: (type, rows) each."""
        return self.m.quant_linear_i8_parts(x, w, bias, [t for t, _ in parts], [n for _, n in parts])

    def paged_attention(self, q, k_cache, v_cache, table, seq, pos, block_size: int, scale: float):
        """q [N, H, D] (rows may be strided, e.g. a slice of the fused qkv output) -> [N, H * D]."""
        return self.m.paged_attention(q, k_cache, v_cache, table, seq, pos, block_size, scale)

    def kv_write_(self, k_cache, v_cache, k, v, slot_mapping) -> None:
        """k/v [N, KV, D] (rows may be strided) into cache slots slot_mapping (int64 [N]), in the cache's dtype."""
        self.m.kv_write_(k_cache, v_cache, k, v, slot_mapping)

    def prefill_attention(self, q, k_cache, v_cache, blocks, start: int, block_size: int, scale: float):
        """Causal attention of one prefill chunk, or None where the fused kernel does not apply
        (not bfloat16, head_dim other than 64, or no AVX512-BF16): the caller falls back to SDPA."""
        if q.dtype != torch.bfloat16 or k_cache.dtype != torch.bfloat16 or q.shape[-1] != 64 or not self._prefill_bf16:
            return None
        return self.m.prefill_attention_bf16(q, k_cache, v_cache, blocks, start, block_size, scale)


def load_cpu_kernels() -> ModuleType | None:
    """The compiled kernel module, building it once per source version; None if unavailable."""
    global _module, _tried
    if _tried:
        return _module
    _tried = True
    if os.environ.get("TANDEM_CPU_KERNELS", "1") == "0":
        return None
    from tandem.paths import cache_dir

    src = b"".join(p.read_bytes() for p in (*_SOURCES, *_HEADERS))
    # -march=native: a build is only valid on a CPU with the same instruction set, so the CPU's
    # flags are part of the key (a cache copied to another machine builds anew, never crashes).
    from tandem.runner.device import cpu_info

    flags = " ".join(sorted(cpu_info().get("flags", "").split()))
    # The sources' folder too: ninja's build file names them by path, so two checkouts sharing one
    # build folder would rebuild it for each other on every start.
    where = str(_SOURCES[0].parent.resolve()).encode()
    key = hashlib.sha256(src + torch.__version__.encode() + flags.encode() + where).hexdigest()[:12]
    build = cache_dir() / "ext" / f"cpu_ops-{key}"
    build.mkdir(parents=True, exist_ok=True)
    _clear_stale_lock(build / "lock")
    try:
        from torch.utils.cpp_extension import load

        _module = load(name=f"tandem_cpu_ops_{key}", sources=[str(p) for p in _SOURCES], build_directory=str(build),
                       extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # no compiler, no ninja, unsupported flags...
        log.warning("Tandem's CPU kernels could not be built (%s); using plain PyTorch ops", e)
        _module = None
    return _module


STALE_LOCK_S = 900.0      # a build takes 1-3 minutes on 2 cores; a lock this old outlived its builder


def _clear_stale_lock(lock: Path) -> None:
    """torch's build lock (a file that other starts wait on until it is gone) is left behind when a
    build is killed (Ctrl-C, a timeout, OOM); every later start would then wait forever. A lock older
    than any build takes is removed."""
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        log.warning("removing a stale kernel build lock %s (%.0f s old: its build was killed)", lock, age)
        lock.unlink(missing_ok=True)


def make_ops(device: torch.device) -> TorchOps | CpuKernelOps:
    if device.type == "cpu":
        module = load_cpu_kernels()
        if module is not None:
            return CpuKernelOps(module)
    return TorchOps()
