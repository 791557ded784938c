"""`tandem bench perplexity`: a model's perplexity on a text, computed as llama.cpp's
`llama-perplexity` computes it, so the two engines' figures compare.

The text is tokenized once (no special tokens added) and cut into chunks of `ctx` tokens, each run
as one prefill with an empty cache; within a chunk only the predictions of its second half are
scored (token i + 1 from tokens 0..i, for i from ctx/2 - 1 on), so every scored token has at least
ctx/2 tokens of context. Perplexity = exp(mean negative log-likelihood over the scored tokens).
The forward pass is the engine's own (its weights, quantized or not, its kernels, its KV cache
dtype), one chunk at a time; the logits of every position are computed, in float32.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from tandem.runner.attention import AttentionBackend, AttentionMetadata, PagedKVCache, PrefillSeq


def chunk_logits(model, ids: list[int], kv_dtype: torch.dtype, block_size: int = 16) -> torch.Tensor:
    """Logits [len(ids), vocab] (float32) of one sequence run as a single prefill."""
    cfg, n = model.cfg, len(ids)
    device = model.embed.device
    cache = PagedKVCache(cfg.num_layers, (n + block_size - 1) // block_size, block_size, cfg.num_kv_heads,
                         cfg.head_dim, kv_dtype, device)
    attn = AttentionBackend(cache, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, model.ops)
    slots = torch.arange(n, device=device)
    meta = AttentionMetadata(slot_mapping=slots, num_batched_tokens=0,
                             prefills=[PrefillSeq(0, n, slots, None, 0)])
    with torch.inference_mode():
        hidden = model(torch.tensor(ids, device=device), slots, attn, meta)
        return model.compute_logits(hidden)


def scored_nll(logits: torch.Tensor, ids: list[int]) -> tuple[float, int]:
    """Sum of -log p(next token) over the chunk's second half, and how many tokens that is."""
    n = len(ids)
    first = n // 2 - 1
    logp = torch.log_softmax(logits[first:n - 1].double(), dim=-1)
    target = torch.tensor(ids[first + 1:n], device=logits.device)
    return float(-logp.gather(1, target[:, None]).sum()), n - 1 - first


def perplexity(llm, text: str, ctx: int = 512, max_chunks: int | None = None, log=print) -> dict[str, Any]:
    """Perplexity of `llm`'s model on `text` (see the module docstring)."""
    if ctx < 4:
        raise ValueError(f"ctx must be at least 4 tokens, got {ctx}")
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    chunks = len(ids) // ctx
    if max_chunks is not None:
        chunks = min(chunks, max_chunks)
    if chunks == 0:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one chunk of {ctx}")
    model = llm.engine.executor.model
    kv_dtype = llm.engine.executor.cache.k[0].dtype
    total, count, per_chunk = 0.0, 0, []
    t0 = time.perf_counter()
    for c in range(chunks):
        part = ids[c * ctx:(c + 1) * ctx]
        nll, n = scored_nll(chunk_logits(model, part, kv_dtype), part)
        total, count = total + nll, count + n
        per_chunk.append(math.exp(nll / n))
        log(f"  chunk {c + 1}/{chunks}: perplexity so far {math.exp(total / count):.4f}")
    return {"bench": "perplexity", "ctx": ctx, "chunks": chunks, "tokens_scored": count,
            "text_tokens": len(ids), "perplexity": math.exp(total / count), "mean_nll": total / count,
            "chunk_perplexity": per_chunk, "wall_s": time.perf_counter() - t0}
