"""Convert a GGUF file (llama / qwen2 / qwen3 architectures) into a Hugging Face model directory.

Tensors are dequantized with the `gguf` package into float32 (Q4_1, Q8_0, ... values are exact in
float32), renamed to Hugging Face names, and llama.cpp's Q/K row permutation (applied to Llama
models for its RoPE layout) is undone. The config comes from the GGUF metadata, the tokenizer and
chat template from transformers' GGUF tokenizer reader. The result is an ordinary directory that
both Tandem and transformers load, which is how Tandem is tested against transformers.

The safetensors file is written as a stream: its header first (every tensor's name, shape and
offset are known from the GGUF's tensor table), then each tensor dequantized a slab of rows at a
time (16 MB of float32; Q/K matrices whole), written, and dropped, and the GGUF mapping's pages
released, so the converter's memory does not grow with the model (a 7B Q4 GGUF no longer needs its
~28 GB of float32 at once; the default model's conversion peaks at ~0.23 GB over the imports, not
~0.93 GB: what remains is the GGUF reader's and the tokenizer's vocabulary tables). The file is
byte for byte what `safetensors.torch.save_file` writes for the same tensors.

Llama 3.1+ GGUFs carry their RoPE scaling as `rope_freqs.weight`, llama.cpp's per-dimension
frequency divisors (head_dim / 2 values). The converter reconstructs Hugging Face's
`rope_scaling: {rope_type: llama3, ...}` from them (`llama3_rope_scaling`) when the divisors are
Llama 3's scheme, checked value by value, so transformers loads the directory as the same model;
other divisors are kept as `rope_freq_factors` in config.json, which Tandem applies to its inverse
frequencies directly (transformers ignores that key: a warning says so).
"""

from __future__ import annotations

import json
import logging
import math
import mmap
import re
import shutil
from pathlib import Path

import numpy as np

from tandem.errors import ModelLoadError

log = logging.getLogger("tandem.gguf")
SLAB_BYTES = 16 * 2**20          # float32 output written per dequantization step (a slab of rows)
LLAMA3_ORIGINAL_CONTEXT = 8192   # llama.cpp's default for original_max_position_embeddings

_ARCH_TO_HF = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight", "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of Q/K rows (interleaved RoPE pairs back to rotate-half halves)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _open(path: Path):
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError, IndexError, struct errors... on damage
        raise ModelLoadError(f"corrupt or truncated GGUF file {path}: {e}") from e


def gguf_field(reader, key: str, default=None):
    """The value of metadata field `key` of GGUF reader `reader` (`default` where it has none)."""
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def read_config(reader) -> dict:
    arch = gguf_field(reader, "general.architecture")
    if arch not in _ARCH_TO_HF:
        raise ModelLoadError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(_ARCH_TO_HF)}")
    model_type, hf_arch = _ARCH_TO_HF[arch]
    g = lambda k, d=None: gguf_field(reader, f"{arch}.{k}", d)  # noqa: E731
    tensors = {t.name: t for t in reader.tensors}
    names = set(tensors)
    heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    tokens = gguf_field(reader, "tokenizer.ggml.tokens", [])
    cfg = {
        "architectures": [hf_arch], "model_type": model_type,
        "vocab_size": int(g("vocab_size", len(tokens))),
        "hidden_size": hidden, "intermediate_size": int(g("feed_forward_length")),
        "num_hidden_layers": int(g("block_count")), "num_attention_heads": heads,
        "num_key_value_heads": int(g("attention.head_count_kv", heads)),
        "head_dim": int(g("attention.key_length", hidden // heads)),
        "max_position_embeddings": int(g("context_length", 2048)),
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(g("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": gguf_field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    scaling = g("rope.scaling.type")
    if scaling == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(g("rope.scaling.factor"))}
    elif scaling not in (None, "none"):
        raise ModelLoadError(f"GGUF rope scaling {scaling!r} is not supported")
    if "rope_freqs.weight" in tensors:
        _rope_freqs(cfg, tensors["rope_freqs.weight"], g("rope.scaling.original_context_length"))
    if model_type == "qwen2":
        cfg["use_sliding_window"] = False
    return cfg


def _rope_freqs(cfg: dict, tensor, original_context: int | None) -> None:
    """Apply llama.cpp's `rope_freqs` divisors to `cfg`: Llama 3 rope_scaling if they are that, else
    `rope_freq_factors` (Tandem applies them; transformers does not)."""
    import gguf

    try:
        factors = gguf.dequantize(tensor.data, tensor.tensor_type).astype(np.float64).reshape(-1)
    except (ValueError, IndexError, TypeError) as e:
        raise ModelLoadError(f"corrupt GGUF tensor rope_freqs.weight: {e}") from e
    if factors.shape != (cfg["head_dim"] // 2,) or not np.all(np.isfinite(factors)) or np.any(factors <= 0):
        raise ModelLoadError(f"GGUF rope_freqs.weight has {factors.size} values (need head_dim / 2 = "
                             f"{cfg['head_dim'] // 2} positive ones)")
    if np.all(factors == 1.0):
        return                              # divisors of 1: plain RoPE
    if cfg.get("rope_scaling"):
        raise ModelLoadError("GGUF with both rope_freqs and a rope scaling type is not supported")
    scaling = llama3_rope_scaling(factors, cfg["rope_theta"], cfg["head_dim"], original_context)
    if scaling is not None:
        cfg["rope_scaling"] = scaling
    else:
        log.warning("GGUF rope_freqs are not Llama 3 RoPE scaling: kept as rope_freq_factors, which Tandem "
                    "applies and transformers ignores (transformers would load a different model)")
        cfg["rope_freq_factors"] = [float(x) for x in factors]


def llama3_divisors(theta: float, head_dim: int, params: dict) -> np.ndarray:
    """The per-dimension divisors llama.cpp's converter writes as rope_freqs for Llama 3 `params`
    (rope_scaling's factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)."""
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    factor, lo, hi = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    smooth = (old / wavelen - lo) / (hi - lo)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old / hi, 1.0, np.where(wavelen > old / lo, factor, mid))


def llama3_rope_scaling(factors: np.ndarray, theta: float, head_dim: int, original_context: int | None = None,
                        rtol: float = 1e-5) -> dict | None:
    """Hugging Face's Llama 3 `rope_scaling` whose divisors (`llama3_divisors`) are `factors`, or None.

    Only two numbers are determined by the divisors: between the two thresholds the smoothing
    factor is linear in 1 / wavelength, (L / wavelen - lo) / (hi - lo), so its slope L / (hi - lo)
    and intercept -lo / (hi - lo) are; (L, lo, hi) are fixed up to one free choice. Candidates,
    each kept only if it reproduces every divisor: Llama 3's own (lo 1, hi 4, L from the GGUF or
    8192), then lo = 1 with the fitted L and hi, then L fixed with the fitted lo and hi."""
    factors = np.asarray(factors, dtype=np.float64)
    factor = float(factors.max())
    old = int(original_context or LLAMA3_ORIGINAL_CONTEXT)
    candidates = [dict(low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=old)]
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    x = inv / (2 * math.pi)                                   # 1 / wavelength
    mid = (factors > 1.0 + rtol) & (factors < factor * (1 - rtol))
    if factor > 1.0 and mid.sum() >= 2:
        smooth = (1 / factors[mid] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(x[mid], smooth, 1)     # smooth = slope * x + intercept
        if slope > 0 and intercept < 0:
            # lo = 1: L = -slope / intercept, hi = 1 - 1 / intercept
            candidates.append(dict(low_freq_factor=1.0, high_freq_factor=float(_round(1 - 1 / intercept)),
                                   original_max_position_embeddings=int(round(-slope / intercept))))
            lo = -intercept * old / slope
            candidates.append(dict(low_freq_factor=float(_round(lo)), high_freq_factor=float(_round(lo + old / slope)),
                                   original_max_position_embeddings=old))
    for c in candidates:
        params = dict(rope_type="llama3", factor=factor, **c)
        if c["high_freq_factor"] > c["low_freq_factor"] > 0 and c["original_max_position_embeddings"] > 0 and \
                np.allclose(llama3_divisors(theta, head_dim, params), factors, rtol=rtol, atol=0):
            return params
    return None


def _round(v: float) -> float:
    """`v` to 6 significant digits (fitted factors come out as 3.9999998 for 4)."""
    return float(f"{v:.6g}")


def _tensor_plan(reader) -> list[tuple[str, object, tuple[int, ...]]]:
    """(Hugging Face name, GGUF tensor, shape) of every tensor the model directory gets, in the
    order safetensors stores them (by name: all are float32)."""
    plan = []
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is not None:
            plan.append((name, t, tuple(int(d) for d in reversed(t.shape.tolist()))))
    if len({name for name, _, _ in plan}) != len(plan):
        raise ModelLoadError("GGUF file has duplicate tensors")
    return sorted(plan, key=lambda e: e[0])


def _safetensors_header(plan) -> bytes:
    """safetensors' header for `plan` (float32 tensors, back to back), as save_file writes it:
    compact JSON padded with spaces to a multiple of 8 bytes, after its 8-byte length."""
    header, offset = {}, 0
    for name, _, shape in plan:
        size = 4 * math.prod(shape)
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def float_slabs(t, name: str, shape: tuple[int, ...], cfg: dict):
    """The tensor's float32 values in row order, a slab of rows at a time (Q/K rows whole: the
    un-permutation moves rows across a head)."""
    import gguf

    if cfg["model_type"] == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
        n = cfg["num_attention_heads"] if "q_proj" in name else cfg["num_key_value_heads"]
        w = gguf.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
        yield unpermute_qk(w, n)
        return
    data = t.data
    if len(shape) < 2 or data.ndim < 2 or data.shape[0] != shape[0]:
        yield gguf.dequantize(data, t.tensor_type).astype(np.float32).reshape(shape)
        return
    row = 4 * math.prod(shape[1:])
    step = max(1, SLAB_BYTES // row)
    for i in range(0, shape[0], step):
        rows = data[i:i + step]
        yield gguf.dequantize(rows, t.tensor_type).astype(np.float32).reshape((rows.shape[0], *shape[1:]))


def release_pages(reader) -> None:
    """Drop the GGUF mapping's pages from this process (they stay in the page cache): reading a
    7B file would otherwise leave all its gigabytes resident in the converter."""
    mm = getattr(reader.data, "_mmap", None)
    if mm is not None and hasattr(mmap, "MADV_DONTNEED"):
        try:
            mm.madvise(mmap.MADV_DONTNEED)
        except (OSError, ValueError):
            pass


def write_safetensors(reader, cfg: dict, out: Path, progress: bool = True, desc: str = "dequantizing") -> None:
    """Stream the GGUF's tensors into the safetensors file `out` (see the module docstring)."""
    from tqdm import tqdm

    plan = _tensor_plan(reader)
    with open(out, "wb") as f:
        f.write(_safetensors_header(plan))
        for name, t, shape in tqdm(plan, desc=desc, disable=not progress, unit="tensor"):
            written = 0
            for w in float_slabs(t, name, shape, cfg):
                w = np.ascontiguousarray(w, dtype="<f4")
                f.write(memoryview(w).cast("B"))
                written += w.size
                del w
            if written != math.prod(shape):
                raise ModelLoadError(f"GGUF tensor {t.name} has {written} values, its shape {shape} needs "
                                     f"{math.prod(shape)}")
            release_pages(reader)


def convert_gguf(path: Path, out_dir: Path, progress: bool = True, float_weights: bool = True) -> Path:
    """Write `out_dir` (config.json, model.safetensors, tokenizer files) from the GGUF at `path`;
    without `float_weights`, no model.safetensors: Tandem's GGUF path reads the blocks from the
    file itself, and `ensure_float_weights` writes the float values when a float load needs them."""
    if not path.is_file():
        raise ModelLoadError(f"no such GGUF file: {path}")
    reader = _open(path)
    cfg = read_config(reader)
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if float_weights:
        _dequantize_into(reader, cfg, path, tmp / "model.safetensors", progress)
    del reader                                   # its vocabulary tables, before the tokenizer reads its own
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    _write_tokenizer(path, tmp)
    from tandem.models.source import record_source

    record_source(tmp, path)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


def _dequantize_into(reader, cfg: dict, path: Path, out: Path, progress: bool) -> None:
    try:
        write_safetensors(reader, cfg, out, progress, desc=f"dequantizing {path.name}")
    except (ValueError, IndexError, TypeError) as e:
        raise ModelLoadError(f"corrupt GGUF tensor data in {path}: {e}") from e


def ensure_float_weights(model_dir: Path, progress: bool = True) -> None:
    """Write the float32 model.safetensors of a directory converted without it, from its GGUF."""
    from tandem.models.source import gguf_source

    if any(model_dir.glob("*.safetensors")):
        return
    source = gguf_source(model_dir)
    if source is None:
        return                                   # not from a GGUF: the loader says what is missing
    reader = _open(source)
    part = model_dir / "model.safetensors.partial"
    _dequantize_into(reader, read_config(reader), source, part, progress)
    part.rename(model_dir / "model.safetensors")


def _write_tokenizer(path: Path, out: Path) -> None:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:  # transformers raises many kinds here
        raise ModelLoadError(f"cannot read the tokenizer of {path}: {e}") from e
    tok.save_pretrained(str(out))
