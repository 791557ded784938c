"""GGUF weights kept quantized for small batches (weight-only Q4_1 / Q8_0 linear layers on CPU).

A decode step at a few rows streams every weight once and does little arithmetic per byte, so its
time is the bytes it reads: Q4_1 is 20 bytes per 32 weights, 6.4x fewer than float32. When a model
comes from a GGUF file, each linear layer whose GGUF tensor is Q4_1 or Q8_0 also keeps those
blocks (read straight from the file, Q/K rows un-permuted like the converter does) and runs the
fused kernel for steps of up to `max_rows` rows; larger steps (prefill chunks, big decode batches)
are compute-bound and use the float weights. In a bfloat16 model on a CPU with AVX512-BF16 the
blocks are repacked at load for `quant_linear_bf16` (csrc/quant_bf16.cpp: the integer q values
times bfloat16 activations on VDPBF16PS, the scales applied per block in float32, so no weight is
rounded); otherwise `quant_linear` (csrc/cpu_ops.cpp) decodes them to float32. The float32 weights
are exactly the blocks' values (the converter dequantizes the same blocks), so the quantized and
float32 paths compute the same function up to summation order; a bfloat16 model's dense weights
are those values rounded to bfloat16, which the quantized path avoids. `max_rows` is measured per
weight shape at load on this CPU (`choose_max_rows`): the largest row count at which the quantized
kernel still wins.

With `activations="int8"` (quantization "gguf", llama.cpp's arithmetic) the Q4_1 and Q8_0 layers of
a float32 model (the default model's LM head is its Q8_0 embedding table) are also repacked for
`quant_linear_i8` (csrc/quant_i8.cpp): each call rounds x to 8 bits per block of 32 (Q8_1 / Q8_0),
as llama.cpp and vLLM's GGUF kernels do, and runs an integer dot product (VPMADDUBSW) that does
four times the multiply-adds of a float32 FMA per instruction. That is not
the float32 function any more (relative error ~0.5% per layer, from the rounding of x), so it is
a mode of its own; `choose_max_rows` measures up to which row count it wins (`i8_max_rows`), which
on a 2-core AVX2 EPYC is every step size, prefill included.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger("tandem.quant")
QTYPES = {"Q4_1": 0, "Q8_0": 1}
SOURCE_FILE = "tandem_gguf_source.json"
_ROWS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
_I8_ROWS = (1, 4, 16, 64, 256)
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
    i8: torch.Tensor | None = None   # quant_pack_i8's records (float32 models, activations="int8")
    i8_max_rows: int = 0             # steps of at most this many rows use quant_linear_i8


def record_source(model_dir: Path, gguf_path: Path) -> None:
    """Note in a converted model directory which GGUF file it came from."""
    (model_dir / SOURCE_FILE).write_text(json.dumps({"gguf": str(gguf_path.resolve())}))


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF file a converted directory came from, if it is still there."""
    marker = model_dir / SOURCE_FILE
    if marker.is_file():
        try:
            path = Path(json.loads(marker.read_text())["gguf"])
        except (ValueError, KeyError, TypeError):
            return None
        return path if path.is_file() else None
    from tandem.models.fetch import DEFAULT_GGUF_MEMBER, DEFAULT_MODEL

    if model_dir.name == DEFAULT_MODEL:      # converted before the marker existed
        path = model_dir.parent / Path(DEFAULT_GGUF_MEMBER).name
        return path if path.is_file() else None
    return None


def _blocks(tensors: dict, name: str) -> tuple[np.ndarray, int] | None:
    t = tensors.get(name)
    if t is None or t.tensor_type.name not in QTYPES:
        return None
    return np.asarray(t.data), QTYPES[t.tensor_type.name]


def attach_gguf(model, gguf_path: Path, ops, activations: str = "float") -> int:
    """Give the model's linear layers their GGUF blocks; returns how many layers got them.
    A fused layer (qkv, gate_up) gets blocks only if all its parts share one supported type.
    `activations` "int8" also packs the layers of a float32 model for `quant_linear_i8`."""
    import gguf

    from tandem.models.gguf_convert import unpermute_qk

    tensors = {t.name: t for t in gguf.GGUFReader(str(gguf_path)).tensors}
    arch = model.cfg
    int8_ready = getattr(ops, "i8_linear_available", lambda: False)()
    permute = arch.model_type == "llama"
    count = 0

    def attach(linear, parts: list[tuple[str, int | None]]) -> None:
        nonlocal count
        got = [_blocks(tensors, name) for name, _ in parts]
        if any(g is None for g in got) or len({g[1] for g in got}) != 1:
            return
        rows = [unpermute_qk(g[0], heads) if heads else g[0] for g, (_, heads) in zip(got, parts)]
        data = torch.from_numpy(np.ascontiguousarray(np.concatenate(rows, axis=0)))
        k = linear.in_features
        if data.shape[0] != linear.out_features or data.shape[1] != k // 32 * (20 if got[0][1] == 0 else 34):
            return
        qtype = got[0][1]
        if linear.dtype == torch.bfloat16 and getattr(ops, "bf16_linear_available", lambda: False)():
            linear.quant = QuantWeight(ops.quant_pack_bf16(data, qtype, linear.out_features, k), qtype, k,
                                       packed_bf16=True)
        else:
            linear.quant = QuantWeight(data, qtype, k)
            if activations == "int8" and int8_ready and linear.dtype == torch.float32:
                linear.quant.i8 = ops.quant_pack_i8(data, linear.out_features, k, qtype)
        linear.quant_ops = ops
        count += 1

    for i, layer in enumerate(model.layers):
        p = f"blk.{i}."
        attach(layer.qkv, [(p + "attn_q.weight", arch.num_heads if permute else None),
                           (p + "attn_k.weight", arch.num_kv_heads if permute else None),
                           (p + "attn_v.weight", None)])
        attach(layer.o, [(p + "attn_output.weight", None)])
        attach(layer.gate_up, [(p + "ffn_gate.weight", None), (p + "ffn_up.weight", None)])
        attach(layer.down, [(p + "ffn_down.weight", None)])
    head = "output.weight" if not arch.tie_word_embeddings and _blocks(tensors, "output.weight") else "token_embd.weight"
    attach(model.lm_head, [(head, None)])
    return count


def choose_max_rows(model, repeats: int = 3) -> dict[tuple[int, int], int]:
    """Per weight shape, the largest row count (of a few) at which the quantized kernel beats the
    float32 path on this CPU; set on every layer of that shape. Where the layers also have int8
    records, `i8_max_rows` is the largest row count up to which `quant_linear_i8` beats both (at
    every probed count; past the largest probe if it still wins there). Each timing runs the
    shape's layers one after another, as a step does, so the float weights come from memory, not
    from a cache that one layer timed alone would stay in. Takes a second or two."""
    from tandem.models.llama import Linear

    by_shape: dict[tuple[int, int], list] = {}
    for m in model.modules():
        if isinstance(m, Linear) and getattr(m, "quant", None) is not None:
            by_shape.setdefault((m.out_features, m.in_features), []).append(m)
    chosen = {}
    for shape, layers in by_shape.items():
        best = 0
        for rows in _ROWS:
            x = torch.randn(rows, shape[1], dtype=layers[0].dtype)
            q = _time(lambda: [m.forward_quant(x) for m in layers], repeats)
            f = _time(lambda: [m.forward_dense(x) for m in layers], repeats)
            if q < f:
                best = rows
            elif rows >= 8:
                break
        i8_best = 0
        if all(m.quant.i8 is not None for m in layers):
            for rows in _I8_ROWS:
                x = torch.randn(rows, shape[1], dtype=layers[0].dtype)
                some = layers if rows < _I8_COMPUTE_ROWS else layers[:4]
                i = _time(lambda: [m.forward_i8(x) for m in some], repeats)
                other = (_time(lambda: [m.forward_quant(x) for m in some], repeats) if rows <= best
                         else _time(lambda: [m.forward_dense(x) for m in some], repeats))
                if i >= other:
                    break
                i8_best = rows if rows < _I8_ROWS[-1] else sys.maxsize
        for m in layers:
            m.quant.max_rows = best
            m.quant.i8_max_rows = i8_best
        chosen[shape] = best
        if i8_best:
            log.info("int8 kernel for %s up to %s rows", shape, "any number of" if i8_best == sys.maxsize else i8_best)
    log.info("quantized kernel up to rows per shape: %s", chosen)
    return chosen


def release_unused_float(model) -> int:
    """Free what a layer whose 8-bit kernel serves every step size (`i8_max_rows` unbounded, as
    `choose_max_rows` finds on an AVX2 CPU) never reads again: its float32 weights in every layout
    and the GGUF blocks of the weight-only kernel. The embedding table stays (a lookup reads it), so
    a tied LM head keeps its weight and loses only its packed copy. Returns the bytes freed. The
    default model goes from 6.15 to 1.56 bytes a parameter on an AVX2 EPYC (a 7B Q4 model would otherwise hold
    ~28 GB of float32 next to its 4 GB of blocks)."""
    from tandem.models.llama import Linear

    freed = 0
    for m in model.modules():
        q = getattr(m, "quant", None)
        if not isinstance(m, Linear) or q is None or q.i8 is None or q.i8_max_rows != sys.maxsize:
            continue
        for name in ("_packed", "_panels", "_panels_bf16"):
            t = getattr(m, name)
            if isinstance(t, torch.Tensor):
                freed += t.numel() * t.element_size()
                setattr(m, name, None)
        if m.weight is not getattr(model, "embed", None) and m.weight.numel():
            freed += m.weight.numel() * m.weight.element_size()
            m.weight.data = torch.empty(0, dtype=m.weight.dtype)
        freed += q.data.numel() * q.data.element_size()
        q.data = torch.empty(0, dtype=torch.uint8)
        q.max_rows = 0
        m.float_released = True
    if freed:
        log.info("released %.0f MB of float weights the 8-bit kernel made unused", freed / 2**20)
    return freed


def _time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]
