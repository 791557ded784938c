"""Convert a GGUF file (llama / qwen2 / qwen3 architectures) into a Hugging Face model directory.

Tensors are dequantized with the `gguf` package into float32 (Q4_1, Q8_0, ... values are exact in
float32), renamed to Hugging Face names, and llama.cpp's Q/K row permutation (applied to Llama
models for its RoPE layout) is undone. The config comes from the GGUF metadata, the tokenizer and
chat template from transformers' GGUF tokenizer reader. The result is an ordinary directory that
both Tandem and transformers load, which is how Tandem is tested against transformers.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np

from tandem.errors import ModelLoadError

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


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    v = f.contents()
    return v


def read_config(reader) -> dict:
    arch = _field(reader, "general.architecture")
    if arch not in _ARCH_TO_HF:
        raise ModelLoadError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(_ARCH_TO_HF)}")
    model_type, hf_arch = _ARCH_TO_HF[arch]
    g = lambda k, d=None: _field(reader, f"{arch}.{k}", d)  # noqa: E731
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ModelLoadError("GGUF files with rope_freqs (Llama 3.1 RoPE scaling) are not supported; "
                             "load the Hugging Face directory instead")
    heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    tokens = _field(reader, "tokenizer.ggml.tokens", [])
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
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    scaling = g("rope.scaling.type")
    if scaling == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(g("rope.scaling.factor"))}
    elif scaling not in (None, "none"):
        raise ModelLoadError(f"GGUF rope scaling {scaling!r} is not supported")
    if model_type == "qwen2":
        cfg["use_sliding_window"] = False
    return cfg


def convert_gguf(path: Path, out_dir: Path, progress: bool = True) -> Path:
    """Write `out_dir` (config.json, model.safetensors, tokenizer files) from the GGUF at `path`."""
    import gguf
    import torch
    from safetensors.torch import save_file
    from tqdm import tqdm

    if not path.is_file():
        raise ModelLoadError(f"no such GGUF file: {path}")
    reader = _open(path)
    cfg = read_config(reader)
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {}
    try:
        for t in tqdm(reader.tensors, desc=f"dequantizing {path.name}", disable=not progress, unit="tensor"):
            name = hf_name(t.name)
            if name is None:
                continue
            w = gguf.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(tuple(reversed(t.shape.tolist())))
            if cfg["model_type"] == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
                n = cfg["num_attention_heads"] if "q_proj" in name else cfg["num_key_value_heads"]
                w = unpermute_qk(w, n)
            tensors[name] = torch.from_numpy(np.ascontiguousarray(w))
    except (ValueError, IndexError, TypeError) as e:
        raise ModelLoadError(f"corrupt GGUF tensor data in {path}: {e}") from e
    save_file(tensors, str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    _write_tokenizer(path, tmp)
    from tandem.models.quant import record_source

    record_source(tmp, path)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


def _write_tokenizer(path: Path, out: Path) -> None:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:  # transformers raises many kinds here
        raise ModelLoadError(f"cannot read the tokenizer of {path}: {e}") from e
    tok.save_pretrained(str(out))
