"""GGUF loading: tiny models written as GGUF (with llama.cpp's Q/K permutation) convert back to the
exact Hugging Face tensors; Tandem on the GGUF generates what transformers does; the default model's
conversion equals transformers' own GGUF loader bit for bit; damaged files give ModelLoadError."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tandem.errors import ModelLoadError
from tandem.models.gguf_convert import convert_gguf

GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf `permute` for Llama Q/K weights (what our converter must undo)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model_dir: Path, out: Path, arch: str) -> Path:
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(str(model_dir))
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    backend = tok.backend_tokenizer
    vocab = backend.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    import json
    merges = json.loads(backend.to_str())["model"]["merges"]
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    w.add_chat_template(tok.chat_template)
    for name, t in load_file(str(model_dir / "model.safetensors")).items():
        a = t.numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            n = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            a = llama_cpp_permute(a, n)
        if name in GGUF_NAMES:
            gname = GGUF_NAMES[name]
        else:
            parts = name.split(".")
            gname = f"blk.{parts[2]}.{LAYER['.'.join(parts[3:])]}"
        w.add_tensor(gname, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.mark.parametrize("arch, gguf_arch", [("llama", "llama"), ("qwen2", "qwen2"), ("qwen3", "qwen3")])
def test_gguf_round_trip_is_exact(tiny_models, tmp_path, arch, gguf_arch):
    from safetensors.torch import load_file

    src = tiny_models[arch]
    path = write_gguf(src, tmp_path / f"{arch}.gguf", gguf_arch)
    out = convert_gguf(path, tmp_path / "converted", progress=False)
    want = load_file(str(src / "model.safetensors"))
    got = load_file(str(out / "model.safetensors"))
    if "lm_head.weight" not in got:   # tied: GGUF has no output.weight
        want.pop("lm_head.weight", None)
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_llm_on_gguf_matches_transformers(tiny_models, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from tandem import LLM, SamplingParams

    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "cache"))
    src = tiny_models["llama"]
    path = write_gguf(src, tmp_path / "tiny.gguf", "llama")
    llm = LLM(model=str(path), dtype="float32", progress=False, kv_cache_dtype="float32")
    prompt = [5, 6, 7, 8, 9, 10]
    ours = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=12, temperature=0,
                                                                                  ignore_eos=True))[0]
    hf = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12)
    assert ours.token_ids == ref[0, len(prompt):].tolist()


def test_damaged_gguf_raises_model_load_error(tiny_models, tmp_path):
    path = write_gguf(tiny_models["llama"], tmp_path / "ok.gguf", "llama")
    data = path.read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[: len(data) // 2])
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + bytes(range(256)) * 10)
    for bad in (truncated, garbage):
        with pytest.raises(ModelLoadError):
            convert_gguf(bad, tmp_path / "out", progress=False)


@pytest.mark.slow
def test_default_model_conversion_equals_transformers_gguf_loader(default_model_dir):
    """Our dequantization of the default model's Q4_1 GGUF, tensor by tensor, against transformers'."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from tandem.models.fetch import DEFAULT_GGUF_MEMBER

    gguf_path = default_model_dir.parent / Path(DEFAULT_GGUF_MEMBER).name
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(default_model_dir)))
    ref = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton)["tensors"]
    ours = load_file(str(default_model_dir / "model.safetensors"))
    assert set(ours) == set(ref)
    for k in ours:
        assert torch.equal(ours[k], torch.as_tensor(ref[k]).float()), k
