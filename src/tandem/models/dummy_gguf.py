"""`tandem model dummy`: a GGUF file of a model shape with random weights, so that llama.cpp and
Tandem run the same model without anyone downloading its weights.

Tensor types are mixed the way llama.cpp's quantizer (`llama_tensor_get_type` in
src/llama-quant.cpp) mixes them for each file type:

- Q4_K_M: Q4_K everywhere, except attn_v and ffn_down in the layers `use_more_bits` picks (the
  first and last eighth, and every third one between) in Q6_K, and the output matrix (the token
  embedding, where it is tied) in Q6_K;
- Q4_0: Q4_0 everywhere, the output matrix (or tied embedding) in Q6_K;
- Q8_0: Q8_0 everywhere.

Norms, biases and Llama 3's RoPE frequency divisors (`rope_freqs.weight`) are float32. The blocks
are random bytes whose float16 scales are set so that the weights have a standard deviation near
the config's initializer_range: what a block costs to read and multiply does not depend on its
values. The tokenizer is the default model's (its GGUF metadata), padded with unused tokens to the
shape's vocabulary size, which llama.cpp requires to match the embedding's rows. The file is
written as a stream, one tensor at a time, so an 8B file needs no more memory than its largest
tensor.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from tandem.errors import ConfigError, ModelLoadError

FILE_TYPES = {"Q4_K_M": 15, "Q4_0": 2, "Q8_0": 7}     # llama_ftype: LLAMA_FTYPE_MOSTLY_*
_GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2"}


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v / ffn_down get more bits in *_K_M files."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_plan(cfg: dict, quantization: str) -> list[tuple[str, tuple[int, ...], str]]:
    """(GGUF tensor name, numpy shape (rows, cols), GGML type name) of every tensor, in file order."""
    if quantization not in FILE_TYPES:
        raise ConfigError(f"unknown quantization {quantization!r} ({', '.join(FILE_TYPES)})")
    h, ff, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    d = cfg.get("head_dim") or h // heads
    vocab, tied = cfg["vocab_size"], bool(cfg.get("tie_word_embeddings", False))
    base = {"Q4_K_M": "Q4_K", "Q4_0": "Q4_0", "Q8_0": "Q8_0"}[quantization]
    out_type = "Q8_0" if quantization == "Q8_0" else "Q6_K"
    bias = cfg["model_type"] == "qwen2" or bool(cfg.get("attention_bias", False))

    def more(i: int) -> str:
        return "Q6_K" if quantization == "Q4_K_M" and use_more_bits(i, n) else base

    plan = [("token_embd.weight", (vocab, h), out_type if tied else base)]
    if _rope_divisors(cfg, d) is not None:
        plan.append(("rope_freqs.weight", (d // 2,), "F32"))
    for i in range(n):
        p = f"blk.{i}."
        plan += [(p + "attn_norm.weight", (h,), "F32"),
                 (p + "attn_q.weight", (heads * d, h), base), (p + "attn_k.weight", (kv_heads * d, h), base),
                 (p + "attn_v.weight", (kv_heads * d, h), more(i))]
        if bias:
            plan += [(p + "attn_q.bias", (heads * d,), "F32"), (p + "attn_k.bias", (kv_heads * d,), "F32"),
                     (p + "attn_v.bias", (kv_heads * d,), "F32")]
        plan += [(p + "attn_output.weight", (h, heads * d), base), (p + "ffn_norm.weight", (h,), "F32"),
                 (p + "ffn_gate.weight", (ff, h), base), (p + "ffn_up.weight", (ff, h), base),
                 (p + "ffn_down.weight", (h, ff), more(i))]
    plan.append(("output_norm.weight", (h,), "F32"))
    if not tied:
        plan.append(("output.weight", (vocab, h), out_type))
    return plan


# Per type: ((byte offset of each float16 scale in a block, its multiple of d), d for weights of
# std 1). Q4_0: w = d (q - 8), q in 0..15; Q8_0: w = d q, q int8; Q4_K / Q5_K: w = d sc q - dmin m
# with 6-bit sc and m, dmin chosen for a zero mean; Q6_K: w = d sc (q - 32), sc int8, q 6-bit.
_SCALES = {"Q4_0": (((0, 1.0),), 1 / 4.6), "Q8_0": (((0, 1.0),), 1 / 74.0),
           "Q4_K": (((0, 1.0), (2, 7.5)), 1 / 269.0), "Q5_K": (((0, 1.0), (2, 15.5)), 1 / 550.0),
           "Q6_K": (((208, 1.0),), 1 / 1370.0)}


def random_blocks(qtype: str, rows: int, cols: int, std: float, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of GGML type `qtype` for a [rows, cols] matrix, as bytes [rows, cols/block * size]."""
    import gguf

    t = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[t]
    if cols % block:
        raise ConfigError(f"{qtype} needs rows of a multiple of {block} values, got {cols}")
    data = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    fields, unit = _SCALES[qtype]
    d = std * unit * rng.uniform(0.5, 1.5, size=(rows, cols // block))
    for off, times in fields:
        data[:, :, off:off + 2] = (d * times).astype(np.float16).view(np.uint8).reshape(rows, cols // block, 2)
    return data.reshape(rows, -1)


def _rope_divisors(cfg: dict, head_dim: int) -> np.ndarray | None:
    """Llama 3's RoPE scaling as llama.cpp's per-frequency divisors (None without it)."""
    scaling = cfg.get("rope_scaling") or {}
    if scaling.get("rope_type", scaling.get("type")) != "llama3":
        return None
    from tandem.models.gguf_convert import llama3_divisors

    return llama3_divisors(float(cfg.get("rope_theta", 10000.0)), head_dim, scaling).astype(np.float32)


def _float_tensor(name: str, shape: tuple[int, ...], cfg: dict) -> np.ndarray:
    if name == "rope_freqs.weight":
        return _rope_divisors(cfg, 2 * shape[0])
    if name.endswith("norm.weight"):
        return np.ones(shape, dtype=np.float32)
    return np.zeros(shape, dtype=np.float32)        # biases


def shape_config(config: str | Path) -> tuple[str, dict]:
    """(name, config dict) of a shipped shape name or a config.json path."""
    from tandem.models.shapes import SHAPES, SHAPES_DIR

    path = SHAPES_DIR / f"{config}.json" if config in SHAPES else Path(config)
    if not path.is_file():
        raise ConfigError(f"--config {config!r} is neither a shape ({', '.join(SHAPES)}) nor a config.json file")
    try:
        cfg = json.loads(path.read_text())
    except ValueError as e:
        raise ConfigError(f"cannot read {path}: {e}") from e
    if cfg.get("model_type") not in _GGUF_ARCH:
        raise ConfigError(f"{path}: model_type {cfg.get('model_type')!r} is not one of {', '.join(_GGUF_ARCH)}")
    return (str(config) if config in SHAPES else path.parent.name), cfg


def write_dummy_gguf(config: str | Path, quantization: str, out: Path, seed: int = 0, progress: bool = True,
                     tokenizer_gguf: Path | None = None) -> Path:
    """Write shape `config` (a shipped shape name or a config.json) with random weights as a GGUF
    file of `quantization` (FILE_TYPES) at `out`; the tokenizer comes from `tokenizer_gguf`
    (default: the default model's GGUF)."""
    import gguf
    from tqdm import tqdm

    name, cfg = shape_config(config)
    plan = tensor_plan(cfg, quantization)
    tok = gguf.GGUFReader(str(tokenizer_gguf or _default_gguf(progress)))
    std = float(cfg.get("initializer_range") or 0.02)
    rng = np.random.default_rng(seed)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    arch = _GGUF_ARCH[cfg["model_type"]]
    w = gguf.GGUFWriter(str(out), arch)
    _metadata(w, name, cfg, quantization, tok)
    for tname, shape, qtype in plan:
        if qtype == "F32":
            w.add_tensor_info(tname, shape, np.dtype(np.float32), 4 * math.prod(shape))
        else:
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
            byte_shape = (shape[0], shape[1] // block * size)
            w.add_tensor_info(tname, byte_shape, np.dtype(np.uint8), math.prod(byte_shape),
                              raw_dtype=gguf.GGMLQuantizationType[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for tname, shape, qtype in tqdm(plan, desc=out.name, unit="tensor", disable=not progress):
        w.write_tensor_data(_float_tensor(tname, shape, cfg) if qtype == "F32"
                            else random_blocks(qtype, shape[0], shape[1], std, rng))
    w.close()
    return out


def _metadata(w, name: str, cfg: dict, quantization: str, tok) -> None:
    import gguf

    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    d = cfg.get("head_dim") or h // heads
    w.add_name(f"{name} (random weights)")
    w.add_context_length(int(cfg.get("max_position_embeddings", 2048)))
    w.add_embedding_length(h)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg.get("num_key_value_heads") or heads)
    w.add_key_length(d)
    w.add_value_length(d)
    w.add_rope_dimension_count(d)
    w.add_rope_freq_base(float(cfg.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(FILE_TYPES[quantization])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _tokenizer(w, cfg["vocab_size"], tok)


def _tokenizer(w, vocab: int, tok) -> None:
    """The tokenizer of GGUF reader `tok`, its token list padded with unused tokens to `vocab`."""
    import gguf

    from tandem.models.gguf_convert import gguf_field

    tokens, types = list(gguf_field(tok, "tokenizer.ggml.tokens")), list(gguf_field(tok, "tokenizer.ggml.token_type"))
    if len(tokens) > vocab:
        raise ConfigError(f"the tokenizer has {len(tokens)} tokens, more than the shape's vocabulary ({vocab})")
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab)]
    types += [gguf.TokenType.UNUSED] * (vocab - len(types))
    w.add_tokenizer_model(gguf_field(tok, "tokenizer.ggml.model"))
    pre = gguf_field(tok, "tokenizer.ggml.pre")
    if pre:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    merges = gguf_field(tok, "tokenizer.ggml.merges")
    if merges:
        w.add_token_merges(list(merges))
    for key, add in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id),
                     ("unknown_token_id", w.add_unk_token_id), ("padding_token_id", w.add_pad_token_id)):
        value = gguf_field(tok, f"tokenizer.ggml.{key}")
        if value is not None:
            add(int(value))
    for key, add in (("add_bos_token", w.add_add_bos_token), ("add_space_prefix", w.add_add_space_prefix)):
        value = gguf_field(tok, f"tokenizer.ggml.{key}")
        if value is not None:
            add(bool(value))
    template = gguf_field(tok, "tokenizer.chat_template")
    if template:
        w.add_chat_template(template)


def _default_gguf(progress: bool) -> Path:
    from tandem.models.fetch import fetch_default_model
    from tandem.models.source import gguf_source

    path = gguf_source(fetch_default_model(progress))
    if path is None:
        raise ModelLoadError("the default model's GGUF file (its tokenizer) is missing from the cache; "
                             "delete the converted default model and run `tandem model fetch`")
    return path
