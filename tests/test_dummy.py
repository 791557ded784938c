"""Random weights from a config alone (`load_format="dummy"`), the shipped shapes, and their errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import make_tokenizer
from tandem import LLM, SamplingParams
from tandem.config import ModelConfig
from tandem.errors import ConfigError, ModelLoadError
from tandem.models.loader import load_arch
from tandem.models.shapes import SHAPES, SHAPES_DIR

# The published shapes: (hidden, intermediate, layers, heads, kv heads, head_dim, vocab, tied, q/k/v bias)
EXPECTED = {
    "llama-3.2-1b": (2048, 8192, 16, 32, 8, 64, 128256, True, False),
    "llama-3.2-3b": (3072, 8192, 28, 24, 8, 128, 128256, True, False),
    "llama-3.1-8b": (4096, 14336, 32, 32, 8, 128, 128256, False, False),
    "qwen2.5-1.5b": (1536, 8960, 28, 12, 2, 128, 151936, True, True),
}


def test_shipped_shapes_are_the_published_configs(tmp_path):
    assert set(SHAPES) == set(EXPECTED)
    for name, want in EXPECTED.items():
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text((SHAPES_DIR / f"{name}.json").read_text())
        a = load_arch(d)
        assert (a.hidden_size, a.intermediate_size, a.num_layers, a.num_heads, a.num_kv_heads, a.head_dim,
                a.vocab_size, a.tie_word_embeddings, a.qkv_bias) == want, name
        assert a.sliding_window is None
        inv, _ = a.rope_inv_freq()
        assert inv.numel() == a.head_dim // 2


def tiny_shape(name: str, out: Path) -> Path:
    """Shape `name` shrunk to 2 layers of width 64 (its architecture, vocabulary, tying and RoPE
    scaling kept), beside a tiny tokenizer."""
    make_tokenizer(out)
    cfg = json.loads((SHAPES_DIR / f"{name}.json").read_text())
    cfg.update(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=4096)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def _greedy(model_dir: Path, dtype: str, seed: int = 0) -> list[int]:
    llm = LLM(str(model_dir), load_format="dummy", dtype=dtype, max_model_len=256, num_kv_blocks=32, seed=seed,
              progress=False)
    out = llm.generate(["Hello world, hello tandem!"], SamplingParams(max_tokens=6, temperature=0.0,
                                                                       ignore_eos=True))
    return out[0].token_ids


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_shape_builds_and_runs_with_random_weights(name, tmp_path):
    d = tiny_shape(name, tmp_path)
    vocab = EXPECTED[name][6]
    ids = _greedy(d, "float32")
    assert len(ids) == 6 and all(0 <= i < vocab for i in ids)
    assert _greedy(d, "float32") == ids                       # the seed fixes the weights
    assert len(_greedy(d, "bfloat16")) == 6


def test_dummy_weights_are_drawn_as_documented(tmp_path):
    from tandem.models.dummy import load_dummy_model

    d = tiny_shape("qwen2.5-1.5b", tmp_path)
    m = load_dummy_model(d, torch.float32, torch.device("cpu"), 64, prepack=False)
    assert abs(float(m.embed.std()) - 0.02) < 1e-3 and abs(float(m.embed.mean())) < 1e-3
    assert torch.equal(m.norm, torch.ones_like(m.norm))
    layer = m.layers[0]
    assert torch.equal(layer.input_norm, torch.ones_like(layer.input_norm))
    assert torch.equal(layer.qkv.bias, torch.zeros_like(layer.qkv.bias))     # qwen2's q/k/v bias
    assert m.lm_head.weight is m.embed                                        # tied, as the config says
    assert abs(float(layer.gate_up.weight.std()) - 0.02) < 1e-3
    again = load_dummy_model(d, torch.float32, torch.device("cpu"), 64, prepack=False)
    other = load_dummy_model(d, torch.float32, torch.device("cpu"), 64, seed=1, prepack=False)
    assert torch.equal(again.layers[1].down.weight, m.layers[1].down.weight)
    assert not torch.equal(other.layers[1].down.weight, m.layers[1].down.weight)


def test_a_shape_without_dummy_says_how_to_run_it(tmp_path):
    d = tiny_shape("llama-3.2-1b", tmp_path)
    with pytest.raises(ModelLoadError, match="load-format dummy"):
        LLM(str(d), max_model_len=256, num_kv_blocks=32, progress=False)


def test_dummy_refuses_quantized_kernels():
    with pytest.raises(ConfigError, match="dummy"):
        ModelConfig(load_format="dummy", quantization="gguf")
    with pytest.raises(ConfigError, match="load_format"):
        ModelConfig(load_format="safetensors-please")


def test_shape_name_resolves_to_its_config_with_the_default_tokenizer(default_model_dir):
    from tandem.models.fetch import resolve_model

    d = resolve_model("llama-3.1-8b", progress=False)
    cfg = json.loads((d / "config.json").read_text())
    default = json.loads((default_model_dir / "config.json").read_text())
    assert cfg["hidden_size"] == 4096 and cfg["vocab_size"] == 128256
    assert cfg["eos_token_id"] == default["eos_token_id"]                  # the stand-in tokenizer's ids
    assert not list(d.glob("*.safetensors"))
    assert resolve_model("llama-3.1-8b", progress=False) == d               # made once


def test_a_shapes_tokenizer_covers_its_vocabulary(default_model_dir):
    """The stand-in tokenizer, padded to the shape's 128,256 ids: text encodes as the default model's
    tokenizer encodes it (no merge forms a pad token, even from its own text), and every id the model
    can sample decodes to text of its own, so a stream carries each token."""
    from tokenizers import Tokenizer

    from tandem.models.fetch import resolve_model

    shape = Tokenizer.from_file(str(resolve_model("llama-3.2-1b", progress=False) / "tokenizer.json"))
    default = Tokenizer.from_file(str(default_model_dir / "tokenizer.json"))
    assert (shape.get_vocab_size(), default.get_vocab_size()) == (128256, 49152)
    text = "Hello [PAD50000] world: café, def f(x): return x ** 2"
    assert shape.encode(text).ids == default.encode(text).ids
    assert shape.decode([50000, 128255]) == "[PAD50000][PAD128255]"
    assert shape.decode([42]) == default.decode([42])
    assert shape.id_to_token(49151) == default.id_to_token(49151) and shape.id_to_token(49152) == "[PAD49152]"


def test_cli_takes_load_format():
    from tandem.cli import build_parser

    a = build_parser().parse_args(["serve", "--model", "llama-3.2-1b", "--load-format", "dummy"])
    assert a.load_format == "dummy" and a.model == "llama-3.2-1b"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--load-format", "pt"])


# --- GGUF files of a shape (tandem model dummy) -------------------------------------------------

def test_more_bits_layers_are_llama_cpps():
    from tandem.models.dummy_gguf import use_more_bits

    # Llama-3.1-8B Q4_K_M (32 layers): attn_v / ffn_down in Q6_K at these layers
    assert [i for i in range(32) if use_more_bits(i, 32)] == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert [i for i in range(16) if use_more_bits(i, 16)] == [0, 1, 4, 7, 10, 13, 14, 15]


@pytest.fixture(scope="module")
def tiny_q4_k_m(tmp_path_factory, default_model_dir):
    """A 4-layer, 256-wide Llama 3 shape with the default model's vocabulary, written as Q4_K_M."""
    from tandem.models.dummy_gguf import write_dummy_gguf

    d = tmp_path_factory.mktemp("dummy-gguf")
    cfg = json.loads((SHAPES_DIR / "llama-3.2-1b.json").read_text())
    cfg.update(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=64, vocab_size=49280, tie_word_embeddings=False)
    (d / "config.json").write_text(json.dumps(cfg))
    return write_dummy_gguf(d / "config.json", "Q4_K_M", d / "tiny.gguf", progress=False), cfg


def test_dummy_gguf_reads_back_with_llama_cpps_types(tiny_q4_k_m):
    import gguf
    import numpy as np

    path, cfg = tiny_q4_k_m
    r = gguf.GGUFReader(str(path))
    types = {t.name: t.tensor_type.name for t in r.tensors}
    shapes = {t.name: tuple(int(x) for x in reversed(t.shape)) for t in r.tensors}
    assert types["token_embd.weight"] == "Q4_K" and types["output.weight"] == "Q6_K"   # untied
    assert [types[f"blk.{i}.attn_v.weight"] for i in range(4)] == ["Q4_K", "Q4_K", "Q6_K", "Q6_K"]
    assert [types[f"blk.{i}.ffn_down.weight"] for i in range(4)] == ["Q4_K", "Q4_K", "Q6_K", "Q6_K"]
    assert {types[f"blk.1.{n}.weight"] for n in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up")} == {"Q4_K"}
    assert types["blk.0.attn_norm.weight"] == "F32" and types["rope_freqs.weight"] == "F32"
    assert shapes["token_embd.weight"] == (49280, 256) and shapes["blk.0.attn_k.weight"] == (128, 256)
    assert shapes["blk.0.ffn_down.weight"] == (256, 512) and shapes["rope_freqs.weight"] == (32,)
    assert len(r.fields["tokenizer.ggml.tokens"].data) == 49280
    assert r.fields["general.file_type"].contents() == 15                  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    assert r.fields["llama.block_count"].contents() == 4
    for name in ("blk.0.attn_q.weight", "blk.3.ffn_down.weight", "token_embd.weight"):
        t = next(t for t in r.tensors if t.name == name)
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        assert np.isfinite(w).all() and 0.015 < float(w.std()) < 0.025 and abs(float(w.mean())) < 2e-3


def test_q6_k_layers_run_the_8_bit_kernel_from_their_own_blocks(tiny_q4_k_m, monkeypatch, tmp_path):
    """In a Q4_K_M file the Q6_K layers (LM head, ffn_down where use_more_bits) get Q6_K records,
    not Q8_0, and the Q4_K layers Q4_K records, not Q4_1; a fused layer of mixed types (Q4_K q/k
    with a Q6_K v) keeps each part's own. The head and a Q4_K layer compute the file's weights
    times x rounded to 8 bits per block of 32, and the decoder stack runs the mixed layers too."""
    from test_gguf_load import assert_stack_matches_python_loop
    import sys

    import gguf

    from tandem.models import fetch, gguf_load
    from tandem.models.quant import Q4_K_I8, Q6_K_I8
    from tandem.runner.kernels import load_cpu_kernels, make_ops

    kernels = load_cpu_kernels()
    if kernels is None or not kernels.i8_linear_available():
        pytest.skip("the 8-bit kernel needs Tandem's CPU kernels on an AVX2 CPU")
    path, cfg = tiny_q4_k_m
    monkeypatch.setattr(fetch, "cache_dir", lambda: tmp_path)
    model_dir = fetch.resolve_model(str(path), progress=False)
    monkeypatch.setattr(gguf_load, "choose_rows", lambda layers: (0, sys.maxsize))      # 8-bit at every size
    model, _ = gguf_load.load_gguf_model(model_dir, path, torch.float32, 64, make_ops(torch.device("cpu")), "int8")
    q4, q6 = Q4_K_I8, Q6_K_I8
    assert [[getattr(layer, a).quant.i8_qtype for a in ("qkv", "o", "gate_up", "down")] for layer in model.layers] \
        == [[q4, q4, q4, q4], [q4, q4, q4, q4], [-1, q4, q4, q6], [-1, q4, q4, q6]]
    mixed = ((q4, 256), (q4, 128), (q6, 128))                                 # q, k, v rows
    assert [layer.qkv.quant.i8_parts for layer in model.layers] == [(), (), mixed, mixed]
    assert model.lm_head.quant.i8_qtype == Q6_K_I8 and model.lm_head.float_released
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    for linear, name in ((model.lm_head, "output.weight"), (model.layers[1].o, "blk.1.attn_output.weight")):
        t = tensors[name]
        w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type)).double()
        x = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(0))
        exact = x.double() @ w.T
        assert torch.linalg.norm(linear(x).double() - exact) < 0.02 * torch.linalg.norm(exact), name
    assert_stack_matches_python_loop(model)


@pytest.mark.slow
def test_tandem_serves_a_dummy_gguf(tiny_q4_k_m):
    path, cfg = tiny_q4_k_m
    llm = LLM(str(path), max_model_len=256, num_kv_blocks=32, progress=False)
    assert llm.engine.vocab_size == 49280
    out = llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 4


def test_dummy_gguf_errors(tmp_path):
    from tandem.models.dummy_gguf import shape_config, tensor_plan

    with pytest.raises(ConfigError, match="neither a shape"):
        shape_config(tmp_path / "missing.json")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ConfigError, match="model_type"):
        shape_config(tmp_path / "config.json")
    with pytest.raises(ConfigError, match="quantization"):
        tensor_plan(json.loads((SHAPES_DIR / "llama-3.2-1b.json").read_text()), "Q3_K_S")
