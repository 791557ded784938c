"""`tandem bench perplexity`: llama.cpp's rule (chunks of ctx tokens, the second half of each
scored) on the engine's own forward pass, held to the same rule computed from transformers."""

from __future__ import annotations

import math

import pytest
import torch

from tandem import LLM
from tandem.bench.perplexity import perplexity
from tandem.cli import main

TEXT = " ".join(f"word{i % 37} and thing{i % 11}." for i in range(200))


def test_perplexity_is_llama_cpp_rule_on_transformers_logits(tiny_llama):
    import transformers

    llm = LLM(model=str(tiny_llama), dtype="float32", progress=False, quantization="none", kv_cache_dtype="float32")
    ctx = 32
    got = perplexity(llm, TEXT, ctx=ctx, max_chunks=3, log=lambda _: None)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    ids = llm.tokenizer.encode(TEXT, add_special_tokens=False)
    total, count = 0.0, 0
    for c in range(3):
        part = ids[c * ctx:(c + 1) * ctx]
        with torch.no_grad():
            logp = torch.log_softmax(hf(torch.tensor([part])).logits[0].double(), -1)
        for i in range(ctx // 2 - 1, ctx - 1):              # token i + 1 from tokens 0..i
            total -= float(logp[i, part[i + 1]])
            count += 1
    assert got["chunks"] == 3 and got["tokens_scored"] == count == 3 * (ctx // 2)
    assert got["perplexity"] == pytest.approx(math.exp(total / count), rel=1e-4)


def test_perplexity_refuses_a_text_shorter_than_a_chunk_and_a_tiny_ctx(tiny_llama):
    llm = LLM(model=str(tiny_llama), dtype="float32", progress=False)
    with pytest.raises(ValueError, match="fewer than one chunk"):
        perplexity(llm, "too short", ctx=512, log=lambda _: None)
    with pytest.raises(ValueError, match="at least 4"):
        perplexity(llm, TEXT, ctx=2, log=lambda _: None)


def test_cli_writes_json_and_reports_a_missing_file(tiny_llama, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    out = tmp_path / "ppl.json"
    assert main(["bench", "perplexity", "--model", str(tiny_llama), "--text", str(text), "--ctx", "32",
                 "--chunks", "2", "--json", str(out)]) == 0
    import json

    data = json.loads(out.read_text())
    assert data["chunks"] == 2 and data["perplexity"] > 1 and data["machine"]
    assert main(["bench", "perplexity", "--model", str(tiny_llama), "--text", str(tmp_path / "nope.txt")]) == 2
    assert "nope.txt" in capsys.readouterr().err
