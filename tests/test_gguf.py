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


def write_gguf(model_dir: Path, out: Path, arch: str, qtype=None, extra: dict | None = None) -> Path:
    """`model_dir` as llama.cpp's converter writes it; `qtype` (a GGMLQuantizationType) quantizes the
    2-D weights, `extra` adds tensors as they are (e.g. rope_freqs.weight)."""
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
        if qtype is not None and a.ndim == 2 and a.shape[1] % 32 == 0:
            w.add_tensor(gname, gguf.quantize(np.ascontiguousarray(a), qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, np.ascontiguousarray(a))
    for gname, a in (extra or {}).items():
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


# --- streamed conversion: one tensor (a slab of rows) at a time, the same file as before -----------

def save_file_conversion(path: Path, out: Path) -> None:
    """The converter as it was before streaming: every tensor dequantized to float32 in memory, then
    one `safetensors.torch.save_file` (the reference the streamed file must equal byte for byte)."""
    import gguf
    from safetensors.torch import save_file

    from tandem.models.gguf_convert import _open, hf_name, read_config, unpermute_qk

    reader = _open(path)
    cfg = read_config(reader)
    tensors = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        w = gguf.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(tuple(reversed(t.shape.tolist())))
        if cfg["model_type"] == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            w = unpermute_qk(w, cfg["num_attention_heads"] if "q_proj" in name else cfg["num_key_value_heads"])
        tensors[name] = torch.from_numpy(np.ascontiguousarray(w))
    save_file(tensors, str(out))


@pytest.mark.parametrize("arch, qtype", [("llama", None), ("llama", "Q8_0"), ("qwen2", "Q4_1"), ("qwen3", "Q4_0")])
def test_streamed_conversion_is_byte_identical_to_save_file(tiny_models, tmp_path, monkeypatch, arch, qtype):
    import hashlib

    import gguf

    from tandem.models import gguf_convert

    monkeypatch.setattr(gguf_convert, "SLAB_BYTES", 1000)         # many slabs per tensor, partial last ones
    path = write_gguf(tiny_models[arch], tmp_path / "m.gguf", arch,
                      qtype=None if qtype is None else gguf.GGMLQuantizationType[qtype])
    out = convert_gguf(path, tmp_path / "converted", progress=False)
    save_file_conversion(path, tmp_path / "reference.safetensors")
    digest = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()   # noqa: E731
    assert digest(out / "model.safetensors") == digest(tmp_path / "reference.safetensors")


@pytest.mark.slow
def test_default_model_streamed_conversion_is_the_same_file(default_model_dir, tmp_path):
    """The default model's GGUF converted again (streamed) gives the cached directory's file, byte for
    byte (the cache was written by the converter that held every tensor in memory)."""
    import hashlib
    import json

    from tandem.models.fetch import DEFAULT_GGUF_MEMBER

    out = convert_gguf(default_model_dir.parent / Path(DEFAULT_GGUF_MEMBER).name, tmp_path / "again", progress=False)

    def digest(p: Path) -> str:
        h = hashlib.sha256()
        with open(p, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
        return h.hexdigest()

    assert digest(out / "model.safetensors") == digest(default_model_dir / "model.safetensors")
    assert json.loads((out / "config.json").read_text()) == json.loads((default_model_dir / "config.json").read_text())


# --- Llama 3.1+ GGUFs: rope_freqs ------------------------------------------------------------------

def llama_cpp_rope_freqs(rope: dict, theta: float, dim: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf writes as rope_freqs.weight for a llama3 rope_scaling
    (LlamaModel.generate_extra_tensors: float32 torch arithmetic, per dimension)."""
    import math

    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope.get("original_max_position_embeddings", 8192)
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32).numpy()


LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 64}


@pytest.mark.parametrize("rope, want", [
    (LLAMA31, LLAMA31),
    # Llama 3.2's factor 32 at 8192 positions: one dimension in the smoothed band
    ({**LLAMA31, "factor": 32.0, "original_max_position_embeddings": 8192},
     {**LLAMA31, "factor": 32.0, "original_max_position_embeddings": 8192}),
    # the divisors fix only L / (hi - lo) and lo / (hi - lo): (lo 2, hi 8, L 128) is (lo 1, hi 4, L 64)
    ({**LLAMA31, "low_freq_factor": 2.0, "high_freq_factor": 8.0, "original_max_position_embeddings": 128}, LLAMA31),
])
def test_gguf_rope_freqs_become_llama3_rope_scaling(tmp_path, rope, want):
    import json

    from test_models import make_llama3_model

    from tandem.models.gguf_convert import llama3_divisors
    from tandem.models.loader import load_arch

    src = make_llama3_model(tmp_path / "hf", rope)
    freqs = llama_cpp_rope_freqs(rope, 10000.0, 16)
    assert 1.0 < freqs.max() and freqs.min() == 1.0
    path = write_gguf(src, tmp_path / "llama31.gguf", "llama", extra={"rope_freqs.weight": freqs})
    out = convert_gguf(path, tmp_path / "converted", progress=False)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["rope_scaling"] == want and "rope_freq_factors" not in cfg
    assert np.allclose(llama3_divisors(10000.0, 16, cfg["rope_scaling"]), freqs, rtol=1e-6, atol=0)
    # Tandem's frequencies are llama.cpp's (the plain ones over rope_freqs) and transformers' own
    inv, _ = load_arch(out).rope_inv_freq()
    plain = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float) / 16))
    torch.testing.assert_close(inv, plain / torch.from_numpy(freqs), rtol=1e-6, atol=0)
    assert torch.equal(inv, load_arch(src).rope_inv_freq()[0])


def test_llm_on_a_llama31_gguf_matches_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    from test_models import make_llama3_model

    from tandem import LLM, SamplingParams

    src = make_llama3_model(tmp_path / "hf")
    path = write_gguf(src, tmp_path / "llama31.gguf", "llama",
                      extra={"rope_freqs.weight": llama_cpp_rope_freqs(LLAMA31, 10000.0, 16)})
    out = convert_gguf(path, tmp_path / "converted", progress=False)
    llm = LLM(model=str(out), dtype="float32", progress=False, kv_cache_dtype="float32", quantization="none",
              kv_cache_memory_gb=0.01)
    prompt = list(range(5, 90))                       # past original_max_position_embeddings (64)
    ours = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=12, temperature=0,
                                                                                  ignore_eos=True))[0]
    hf = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12)
    assert ours.token_ids == ref[0, len(prompt):].tolist()


def test_llama3_rope_scaling_fit():
    from tandem.models.gguf_convert import llama3_divisors, llama3_rope_scaling

    theta, dim = 500000.0, 128                         # Llama 3.1 8B
    llama31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    assert llama3_rope_scaling(llama3_divisors(theta, dim, llama31), theta, dim) == llama31
    for factor in (8.0, 32.0):                         # llama.cpp's float32 values: Llama 3.1 and 3.2
        params = {**llama31, "factor": factor}
        assert llama3_rope_scaling(llama_cpp_rope_freqs(params, theta, dim), theta, dim) == params
    # an L that makes lo = 1 impossible with an integer L: L stays 8192 and lo, hi are fitted
    odd = {**llama31, "low_freq_factor": 1.5, "original_max_position_embeddings": 100}
    got = llama3_rope_scaling(llama3_divisors(10000.0, 64, odd), 10000.0, 64)
    assert got["original_max_position_embeddings"] == 8192
    assert np.allclose(llama3_divisors(10000.0, 64, got), llama3_divisors(10000.0, 64, odd), rtol=1e-6)
    rng = np.random.default_rng(0)
    assert llama3_rope_scaling(1 + rng.random(32) * 3, 10000.0, 64) is None


def test_other_rope_freqs_are_applied_directly(tiny_models, tmp_path, caplog):
    import json

    from tandem.models.loader import load_arch

    factors = np.array([1.0, 1.5, 1.2, 3.0, 2.0, 5.0, 4.0, 9.0], dtype=np.float32)   # no Llama 3 shape
    path = write_gguf(tiny_models["llama"], tmp_path / "odd.gguf", "llama", extra={"rope_freqs.weight": factors})
    out = convert_gguf(path, tmp_path / "converted", progress=False)
    cfg = json.loads((out / "config.json").read_text())
    assert "rope_scaling" not in cfg and cfg["rope_freq_factors"] == factors.tolist()
    assert "transformers ignores" in caplog.text
    inv, _ = load_arch(out).rope_inv_freq()
    plain, _ = load_arch(tiny_models["llama"]).rope_inv_freq()
    assert torch.equal(inv, plain / torch.from_numpy(factors))
    bad = write_gguf(tiny_models["llama"], tmp_path / "bad.gguf", "llama",
                     extra={"rope_freqs.weight": np.ones(5, dtype=np.float32) * 2})
    with pytest.raises(ModelLoadError, match="rope_freqs.weight has 5 values"):
        convert_gguf(bad, tmp_path / "bad", progress=False)
