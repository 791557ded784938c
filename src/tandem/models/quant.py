"""GGUF weights kept quantized (weight-only Q4_1 / Q8_0 linear layers, and the 8-bit-activation kernel, on CPU).

A decode step at a few rows streams every weight once and does little arithmetic per byte, so its
time is the bytes it reads: Q4_1 is 20 bytes per 32 weights, 6.4x fewer than float32. When a model
comes from a GGUF file, each linear layer whose GGUF tensor is Q4_1 or Q8_0 gets those blocks
(`attach_blocks`: read straight from the file, Q/K rows un-permuted like the converter does), and
tandem.models.gguf_load decides per weight shape which kernel runs which step size and whether
the layer holds float weights at all. In a bfloat16 model on a CPU with AVX512-BF16 the blocks are
repacked for `quant_linear_bf16` (csrc/quant_bf16.cpp: the integer q values times bfloat16
activations on VDPBF16PS, the scales applied per block in float32, so no weight is rounded);
otherwise `quant_linear` (csrc/quant_linear.cpp) decodes them to float32. The float32 weights are
exactly the blocks' values (the converter dequantizes the same blocks), so the weight-only and
float32 paths compute the same function up to summation order. `max_rows` is measured per weight
shape at load on this CPU (`choose_rows`): the largest row count at which the quantized kernel
still wins.

With `activations="int8"` (quantization "gguf", llama.cpp's arithmetic) the Q4_1 and Q8_0 layers of
a float32 or bfloat16 model (the default model's LM head is its Q8_0 embedding table) are also repacked for
`quant_linear_i8` (csrc/quant_i8.cpp), and so are layers whose blocks are all Q6_K or all Q4_K,
from the file's own bits (`NATIVE_I8`: 7 bits a weight where Q8_0 takes 8.5, 4.625 where Q4_1
takes 5): each call rounds x to 8 bits per block of 32 (Q8_1 / Q8_0),
as llama.cpp and vLLM's GGUF kernels do, and runs an integer dot product (VPMADDUBSW) that does
four times the multiply-adds of a float32 FMA per instruction. That is not the float32 function
any more (relative error ~0.5% per layer, from the rounding of x), so it is a mode of its own;
`choose_rows` measures up to which row count it wins (`i8_max_rows`); where that is every step size,
prefill included, the layer holds no float weights (`release_layer`). In a
bfloat16 model on AVX512-BF16 it wins up to a few rows (VDPBF16PS on bf16 weights takes over
above), and the weight-only blocks it covers are freed (`release_shadowed_blocks`).
`RowTable` reads a GGUF matrix's rows from the file for the embedding lookup and the LM head's rows.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger("tandem.quant")
QTYPES = {"Q4_1": 0, "Q8_0": 1}
# quant_pack_i8's record types for K-quant blocks: the 8-bit kernel runs them from their own bits
Q6_K_I8, Q4_K_I8 = 2, 3
NATIVE_I8 = {"Q6_K": Q6_K_I8, "Q4_K": Q4_K_I8}
_ROWS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
_I8_ROWS = (1, 2, 4, 8, 16, 64, 256)   # fine where bfloat16 kernels take over at a few rows
_I8_COMPUTE_ROWS = 64     # from here steps are compute-bound: a few layers time the shape (load stays short)


@dataclass
class QuantWeight:
    """A layer's GGUF blocks in one of two layouts: as the file stores them (`packed_bf16` False:
    uint8 [N, K / 32 * block bytes], for `quant_linear`, float32 activations) or repacked for
    bfloat16 activations on AVX512-BF16 CPUs (`packed_bf16` True: `quant_linear_bf16`'s records,
    csrc/quant_bf16.cpp)."""

    data: torch.Tensor
    qtype: int                  # QTYPES value
    in_features: int
    max_rows: int = 0           # steps of at most this many rows use the quantized kernel
    packed_bf16: bool = False
    i8: torch.Tensor | None = None   # quant_pack_i8's records (float32 or bfloat16 models, activations="int8")
    i8_max_rows: int = 0             # steps of at most this many rows use quant_linear_i8
    i8_qtype: int = 0                # the records' type: QTYPES or NATIVE_I8 values (-1: see i8_parts)
    i8_parts: tuple[tuple[int, int], ...] = ()   # a fused layer whose parts' types differ: (type, rows) each


# GGUF types the kernels take after a repack at load, one tensor at a time: to Q4_1 records exactly
# (Q4_0: m = -8 d; Q4_K: each 32-weight sub-block's 6-bit scale and min folded into a Q4_1 block's
# float16 d and m, rounded to float16 as the only change), or, for 5- and 6-bit types, requantized
# to Q8_0 (8 bits per weight, one scale per 32; the rounding adds ~1/254 of a block's largest weight).
# The 8-bit kernel runs a layer of Q6_K or Q4_K blocks from the file's bits instead (NATIVE_I8).
REPACKED = {"Q4_0": 0, "Q4_K": 0, "Q5_0": 1, "Q5_1": 1, "Q5_K": 1, "Q6_K": 1}


def _kernel_type(t) -> int | None:
    """The QTYPES value a GGUF tensor runs as (stored or after a repack), or None: no kernel."""
    if t is None:
        return None
    kind = t.tensor_type.name
    return QTYPES.get(kind, REPACKED.get(kind))


def _blocks(t, qtype: int) -> np.ndarray:
    """The tensor's rows (uint8 [rows, bytes]) as kernel blocks of `qtype`: as stored, repacked
    (REPACKED), or requantized to Q8_0 (any type, when a fused layer's parts differ)."""
    kind, data = t.tensor_type.name, np.asarray(t.data)
    if QTYPES.get(kind) == qtype:
        return data
    if qtype == 1:
        return requant_q8_0(data, t.tensor_type)
    return q4_0_to_q4_1(data) if kind == "Q4_0" else q4_k_to_q4_1(data)


def q4_0_to_q4_1(rows: np.ndarray) -> np.ndarray:
    """Q4_0 rows (18-byte blocks: d, 16 bytes of q; w = d (q - 8)) as Q4_1 (d, m = -8 d, the same q): exact."""
    n = rows.shape[0]
    b = rows.reshape(-1, 18)
    d = b[:, :2].view(np.float16)
    m = (d.astype(np.float32) * -8).astype(np.float16)
    return np.concatenate([b[:, :2], m.view(np.uint8), b[:, 2:]], axis=1).reshape(n, -1)


def q4_k_to_q4_1(rows: np.ndarray) -> np.ndarray:
    """Q4_K rows (144-byte super-blocks of 256 weights: float16 d and dmin, 12 bytes of 6-bit scales
    and mins for 8 sub-blocks, 128 bytes of q; w = d sc_j q - dmin m_j) as Q4_1 blocks, one per
    sub-block (d' = d sc_j, m' = -dmin m_j in float16, the same q). gguf's own unpacking of the
    scales; the nibbles move from Q4_K's order (sub-blocks 2c and 2c+1 share 32 bytes, low and
    high nibbles) to Q4_1's (weights l and l+16 share a byte)."""
    import gguf

    n = rows.shape[0]
    b = rows.reshape(-1, 144)
    d = b[:, 0:2].view(np.float16).astype(np.float32)
    dmin = b[:, 2:4].view(np.float16).astype(np.float32)
    sc, mn = gguf.quants.Q4_K.get_scale_min(b[:, 4:16])                    # [B, 8] each
    d_sub = (d * sc.astype(np.float32)).astype(np.float16)
    m_sub = (-dmin * mn.astype(np.float32)).astype(np.float16)
    q = b[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (q & np.uint8(0x0F)).reshape(-1, 8, 32)                            # [B, sub-block, weight]
    packed = q[..., :16] | (q[..., 16:] << np.uint8(4))
    out = np.concatenate([d_sub.view(np.uint8).reshape(-1, 8, 2), m_sub.view(np.uint8).reshape(-1, 8, 2), packed],
                         axis=2)
    return out.reshape(n, -1)


def requant_q8_0(rows: np.ndarray, tensor_type, slab_rows: int = 1024) -> np.ndarray:
    """Any GGUF type's rows requantized to Q8_0, a slab of rows at a time (so the float values of
    at most `slab_rows` rows exist at once)."""
    import gguf

    out = [gguf.quantize(gguf.dequantize(rows[i:i + slab_rows], tensor_type).astype(np.float32),
                         gguf.GGMLQuantizationType.Q8_0) for i in range(0, rows.shape[0], slab_rows)]
    return np.concatenate(out, axis=0)


def gguf_parts(arch, i: int) -> dict[str, list[tuple[str, int | None]]]:
    """Layer i's fused linear layers (attribute name) -> their GGUF tensors, each with the head
    count whose Q/K row permutation (llama.cpp's, for Llama's RoPE) is undone, or None."""
    p, llama = f"blk.{i}.", arch.model_type == "llama"
    return {"qkv": [(p + "attn_q.weight", arch.num_heads if llama else None),
                    (p + "attn_k.weight", arch.num_kv_heads if llama else None), (p + "attn_v.weight", None)],
            "o": [(p + "attn_output.weight", None)],
            "gate_up": [(p + "ffn_gate.weight", None), (p + "ffn_up.weight", None)],
            "down": [(p + "ffn_down.weight", None)]}


def head_tensor(tensors: dict) -> str:
    """The GGUF tensor of the LM head: output.weight, or the token embedding a tied model reuses."""
    return "output.weight" if "output.weight" in tensors else "token_embd.weight"


_BLOCK_BYTES = {0: (32, 20), 1: (32, 34), Q6_K_I8: (256, 210), Q4_K_I8: (256, 144)}   # record type -> (weights, bytes)


def _i8_part(t, heads: int | None, k: int, as_type) -> tuple[np.ndarray, int] | None:
    """A part's blocks for the 8-bit kernel and their record type: K-quants as the file stores
    them (NATIVE_I8), other types as the weight-only kernel takes them (`as_type(qtype)`, Q/K rows
    un-permuted); None if the row size does not fit."""
    from tandem.models.gguf_convert import unpermute_qk

    kind = t.tensor_type.name
    if kind in NATIVE_I8 and k % 256 == 0:
        rtype, blocks = NATIVE_I8[kind], np.asarray(t.data)
        blocks = unpermute_qk(blocks, heads) if heads else blocks
    else:
        rtype = _kernel_type(t)
        blocks = as_type(rtype)
    weights, nbytes = _BLOCK_BYTES[rtype]
    return (blocks, rtype) if blocks.shape[1] == k // weights * nbytes else None


def _read_only(blocks: np.ndarray) -> torch.Tensor:
    """`blocks` (perhaps the file's own mapped pages: a single part is not copied) as a tensor
    that quant_pack_i8 only reads."""
    import warnings

    with warnings.catch_warnings():          # a read-only file mapping: the packer never writes it
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.ascontiguousarray(blocks))


def attach_blocks(linear, tensors: dict, parts: list[tuple[str, int | None]], ops, activations: str,
                  weight_only: bool = True) -> bool:
    """Give `linear` the GGUF blocks of `parts` (stacked in order), in the layout its dtype and
    `activations` ("int8" also packs a float32 or bfloat16 layer for `quant_linear_i8`) want; False, and
    nothing attached, unless every part is one supported type and the shapes fit. `weight_only`
    False: the layer will run the 8-bit kernel at every step size, so the weight-only kernel's
    blocks are not built (when there are 8-bit records)."""
    from tandem.models.gguf_convert import unpermute_qk

    types = [_kernel_type(tensors.get(name)) for name, _ in parts]
    if None in types:
        return False
    k = linear.in_features
    i8 = activations == "int8" and getattr(ops, "i8_linear_available", lambda: False)() \
        and linear.dtype in (torch.float32, torch.bfloat16)
    made: dict[tuple[str, int], np.ndarray] = {}

    def as_type(name: str, heads: int | None, qtype: int) -> np.ndarray:
        """Part `name`'s blocks as kernel type `qtype`, Q/K rows un-permuted: made once per type (a
        repack or requantization serves both kernels)."""
        if (name, qtype) not in made:
            got = _blocks(tensors[name], qtype)
            made[(name, qtype)] = unpermute_qk(got, heads) if heads else got
        return made[(name, qtype)]

    i8_parts = [_i8_part(tensors[name], heads, k, lambda q, n=name, h=heads: as_type(n, h, q))
                for name, heads in parts] if i8 else []
    if None in i8_parts or sum(b.shape[0] for b, _ in i8_parts) not in (0, linear.out_features):
        return False
    qtype = types[0] if len(set(types)) == 1 else 1   # mixed (Q4_K_M's Q4_K q/k with Q6_K v): all Q8_0
    if i8 and not weight_only:
        data = torch.empty(0, dtype=torch.uint8)
    else:
        rows = [as_type(name, heads, qtype) for name, heads in parts]
        data = torch.from_numpy(np.ascontiguousarray(np.concatenate(rows, axis=0)))
        weights, nbytes = _BLOCK_BYTES[qtype]
        if data.shape[0] != linear.out_features or data.shape[1] != k // weights * nbytes:
            return False
    if data.numel() and linear.dtype == torch.bfloat16 and getattr(ops, "bf16_linear_available", lambda: False)():
        linear.quant = QuantWeight(ops.quant_pack_bf16(data, qtype, linear.out_features, k), qtype, k,
                                   packed_bf16=True)
    else:
        linear.quant = QuantWeight(data, qtype, k)
    if i8:
        # K-quants run from the file's bits: Q6_K in 7 bits a weight (not Q8_0's 8.5), Q4_K in
        # 4.625 (not Q4_1's 5, and its scales not rounded); a fused layer whose parts differ in
        # type keeps each part's own records
        rtypes = {rtype for _, rtype in i8_parts}
        q = linear.quant
        if len(rtypes) == 1:
            rtype = rtypes.pop()
            blocks = i8_parts[0][0] if len(i8_parts) == 1 else np.concatenate([b for b, _ in i8_parts], axis=0)
            q.i8, q.i8_qtype = ops.quant_pack_i8(_read_only(blocks), linear.out_features, k, rtype), rtype
        else:
            packs = [ops.quant_pack_i8(_read_only(b), b.shape[0], k, rtype) for b, rtype in i8_parts]
            q.i8 = torch.cat([p.reshape(-1) for p in packs])
            q.i8_parts = tuple((rtype, b.shape[0]) for b, rtype in i8_parts)
            q.i8_qtype = -1
    linear.quant_ops = ops
    return True


def choose_rows(layers: list, repeats: int = 5, cold: bool = True) -> tuple[int, int]:
    """For layers of one weight shape: the largest row count (of a few) at which the weight-only
    quantized kernel beats the float path on this CPU (`max_rows`), and, where the layers have int8
    records, the largest up to which `quant_linear_i8` beats both at every probed count
    (`i8_max_rows`; sys.maxsize past the largest probe if it still wins there). Each verdict is the
    median of `repeats` paired timings, the two kernels run back to back in alternating order, so a
    VM's drift hits both alike (single timings flipped the bfloat16 crossovers from load to load).
    `cold` times each call after evicting the caches (`_Evict`), so one layer's weights come from
    memory as every layer's do in a step; takes about a second per shape."""
    evict = _Evict() if cold else None
    k, dtype = layers[0].in_features, layers[0].dtype
    best = 0
    for rows in _ROWS:
        x = torch.randn(rows, k, dtype=dtype)
        if _faster(lambda: [m.forward_quant(x) for m in layers], lambda: [m.forward_dense(x) for m in layers],
                   repeats, evict):
            best = rows
        elif rows >= 8:
            break
    i8_best = 0
    if all(m.quant.i8 is not None for m in layers):
        for rows in _I8_ROWS:
            x = torch.randn(rows, k, dtype=dtype)
            some = layers if rows < _I8_COMPUTE_ROWS else layers[:4]
            other = ((lambda: [m.forward_quant(x) for m in some]) if rows <= best
                     else (lambda: [m.forward_dense(x) for m in some]))
            if not _faster(lambda: [m.forward_i8(x) for m in some], other, repeats, evict):
                break
            i8_best = rows if rows < _I8_ROWS[-1] else sys.maxsize
    return best, i8_best


def release_layer(m) -> int:
    """Free what a layer whose 8-bit kernel serves every step size (`i8_max_rows` unbounded, as
    `choose_rows` finds on an AVX2 CPU) never reads again: its float weights in every layout and
    the GGUF blocks of the weight-only kernel. Returns the bytes freed; the layer's dense paths
    raise a clear error from then on."""
    q = m.quant
    if q is None or q.i8 is None or q.i8_max_rows != sys.maxsize:
        return 0
    freed = 0
    for name in ("_packed", "_panels", "_panels_bf16"):
        t = getattr(m, name)
        if isinstance(t, torch.Tensor):
            freed += t.numel() * t.element_size()
            setattr(m, name, None)
    if m.weight.numel():
        freed += m.weight.numel() * m.weight.element_size()
    m.weight = torch.nn.Parameter(torch.empty(0, dtype=m.weight.dtype), requires_grad=False)   # untied, if it was
    freed += q.data.numel() * q.data.element_size()
    q.data = torch.empty(0, dtype=torch.uint8)
    q.max_rows = 0
    m.float_released = True
    return freed


def release_shadowed_blocks(m) -> int:
    """Free the weight-only kernel's blocks of a layer where the 8-bit kernel takes every step size
    they would have served (`max_rows <= i8_max_rows`, as `choose_rows` finds for bfloat16 models on
    AVX512-BF16: 8-bit up to a few rows, the bfloat16 weights above). Returns the bytes freed."""
    q = m.quant
    if q is None or q.i8 is None or q.max_rows > q.i8_max_rows or not q.data.numel():
        return 0
    freed = q.data.numel() * q.data.element_size()
    q.data = torch.empty(0, dtype=torch.uint8)
    q.max_rows = 0
    return freed


class RowTable:
    """Rows of a GGUF matrix as the file stores them (memory-mapped: only the rows read become
    resident), dequantized when asked for: the token embedding without a float copy of the table,
    and the LM head's rows where its float weights were released."""

    def __init__(self, tensor, dtype: torch.dtype) -> None:
        self.data = np.asarray(tensor.data)          # [rows, bytes per row] (quantized) or [rows, width]
        self.qtype = tensor.tensor_type
        self.dtype = dtype
        self.num_rows = int(tensor.shape[-1])
        self.width = int(tensor.shape[0])
        self._torch = None                           # the rows as a torch view (types rows() reads in torch)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.detach().cpu()                     # index_select raises IndexError on an id out of range
        kind = self.qtype.name
        if kind in ("F32", "F16", "BF16", "Q8_0"):      # in torch: a decode step looks a row up per token
            if self._torch is None:
                import warnings

                with warnings.catch_warnings():          # a read-only file mapping: torch never writes it
                    warnings.simplefilter("ignore", UserWarning)
                    raw = torch.from_numpy(self.data)
                self._torch = raw.view(torch.bfloat16) if kind == "BF16" else raw
            picked = self._torch.index_select(0, ids.reshape(-1))
            if kind == "Q8_0":
                b = picked.view(-1, 34)
                picked = b[:, 2:].view(torch.int8).float() * b[:, :2].contiguous().view(torch.float16).float()
            return picked.reshape(*ids.shape, self.width).to(self.dtype)
        import gguf

        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_rows):
            raise IndexError(f"row index out of range [0, {self.num_rows})")
        out = gguf.dequantize(self.data[ids.numpy().reshape(-1)], self.qtype).reshape(*ids.shape, self.width)
        return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).to(self.dtype)


class _Evict:
    """Evicts the CPU caches by writing a buffer twice the last-level cache (64 MB if unknown)."""

    def __init__(self) -> None:
        size = 32 * 2**20
        try:
            text = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
            size = int(text[:-1]) * {"K": 2**10, "M": 2**20}[text[-1]] if text[-1] in "KM" else int(text)
        except (OSError, ValueError, IndexError):
            pass
        self.buf = torch.empty(min(2 * size, 2**28), dtype=torch.uint8)

    def __call__(self) -> None:
        self.buf.fill_(1)


def _faster(a, b, repeats: int, evict=None) -> bool:
    """True when `a` takes less time than `b`: the median of `repeats` paired ratios, each pair run
    back to back (order alternating), after a warm-up call of each."""
    a()
    b()
    ratios = []
    for i in range(repeats):
        first, second = (a, b) if i % 2 == 0 else (b, a)
        t_first, t_second = _timed(first, evict), _timed(second, evict)
        ratios.append(t_first / t_second if first is a else t_second / t_first)
    return sorted(ratios)[len(ratios) // 2] < 1.0


def _timed(fn, evict=None) -> float:
    if evict is not None:
        evict()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
