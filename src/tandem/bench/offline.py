"""`tandem bench offline`: engine throughput on a prompt set at fixed concurrencies, no HTTP.

For each concurrency C, C requests (cycling through the prompt set, chat template applied, greedy,
`ignore_eos` so every request produces its `max_tokens`) are submitted at once; we report output
tokens/s over the whole run, the median decode-only step time, and that step time against two
rooflines: memory, (weight bytes + KV bytes read per step) / measured read bandwidth, and compute,
(2 x linear-layer parameters x C FLOPs) / measured dense-matmul FLOP/s. The binding one is the
larger. Repeats run interleaved across concurrencies and the median is reported.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from tandem.bench.common import (machine_info, matmul_tflops, median, memory_bandwidth_gbs, peak_rss_mb,
                                 write_json)
from tandem.sampling_params import SamplingParams
from tandem.workload.prompts import load_prompt_set


def run_once(llm, prompts: list[list[int]], max_tokens: list[int]) -> dict[str, Any]:
    eng = llm.engine
    for ids, mt in zip(prompts, max_tokens):
        eng.add_request(prompt_token_ids=ids, params=SamplingParams(max_tokens=mt, temperature=0.0, ignore_eos=True))
    decode_steps, ctx_tokens = [], []
    n_out, t0 = 0, time.perf_counter()
    while eng.has_unfinished_requests():
        outs = eng.step()
        n_out += sum(len(o.delta_token_ids) for o in outs)
        info = eng.last_step
        if info is not None and info.decode_only and info.num_seqs == len(prompts):
            decode_steps.append(info.duration_s)
            running = eng.scheduler.running
            ctx_tokens.append(sum(r.num_computed_tokens for r in running) / max(1, len(running)))
    wall = time.perf_counter() - t0
    return {"output_tokens": n_out, "wall_s": wall, "output_tok_s": n_out / wall,
            "decode_step_ms": 1e3 * median(decode_steps) if decode_steps else None,
            "mean_context_tokens": sum(ctx_tokens) / len(ctx_tokens) if ctx_tokens else None}


def linear_parameters(model) -> int:
    """Weights of the linear layers, the LM head included (the embedding is a gather)."""
    arch = model.cfg
    per_layer = (arch.q_size + 2 * arch.kv_size) * arch.hidden_size + arch.q_size * arch.hidden_size \
        + 3 * arch.intermediate_size * arch.hidden_size
    return arch.num_layers * per_layer + arch.vocab_size * arch.hidden_size


def weight_bytes(model) -> int:
    """Bytes of weights a decode step reads: every linear layer once, in the layout its small steps
    run (a GGUF layer's 8-bit records where it has them, else its float weights)."""
    from tandem.models.llama import Linear

    total = 0
    for m in model.modules():
        if not isinstance(m, Linear):
            continue
        q = m.quant
        if q is not None and q.i8 is not None:
            total += q.i8.numel() * q.i8.element_size()
        else:
            total += m.out_features * m.in_features * model.embed.element_size()
    return total


def weight_memory(model) -> dict[str, float]:
    """The model's parameter count and the bytes its weights hold in memory, in every layout kept
    (plain tensors, prepacked panels, oneDNN's layout, GGUF blocks, 8-bit-activation records), each
    tensor counted once."""
    from tandem.models.llama import Linear

    arch = model.cfg
    tensors, params = {}, arch.vocab_size * arch.hidden_size      # the embedding
    for table in (model.embed_table, model.head_table):           # GGUF rows, mapped from the file
        if table is not None:
            tensors[table.data.ctypes.data] = table.nbytes
    for name, p in model.named_parameters():
        if p.numel():
            tensors[p.data_ptr()] = p.numel() * p.element_size()
        if p.dim() == 1 or name.endswith("bias"):                 # norms and biases (the embedding: above)
            params += p.numel()
    for m in model.modules():
        if not isinstance(m, Linear):
            continue
        if m is not model.lm_head or not arch.tie_word_embeddings:
            params += m.out_features * m.in_features
        q = m.quant
        held = [m._packed, m._panels, m._panels_bf16] + ([q.data, q.i8] if q is not None else [])
        for t in held:
            if isinstance(t, torch.Tensor) and t.numel():
                tensors[t.data_ptr()] = t.numel() * t.element_size()
    resident = sum(tensors.values())
    return {"parameters": params, "weight_resident_bytes": resident, "bytes_per_parameter": resident / params}


def bench_offline(llm, concurrencies: list[int], repeats: int = 3, dataset: str | None = None,
                  max_tokens: int | None = None, json_path: str | None = None, log=print) -> dict[str, Any]:
    items = load_prompt_set(dataset)
    tok = llm.tokenizer
    encoded = [tok.apply_chat_template(p.messages) for p in items]
    caps = [max_tokens or p.max_tokens for p in items]
    model = llm.engine.executor.model
    arch = model.cfg
    kv_bytes_per_token = 2 * arch.num_layers * arch.kv_size * llm.engine.executor.cache.k[0].element_size()
    wbytes = weight_bytes(model)
    flops_per_token = 2 * linear_parameters(model)
    run_once(llm, encoded[:1], [8])      # warm-up
    results: dict[int, list[dict]] = {c: [] for c in concurrencies}
    for r in range(repeats):
        for c in concurrencies:
            idx = [i % len(items) for i in range(c)]
            res = run_once(llm, [encoded[i] for i in idx], [caps[i] for i in idx])
            results[c].append(res)
            log(f"  repeat {r + 1}/{repeats} C={c}: {res['output_tok_s']:.1f} tok/s, "
                f"decode step {res['decode_step_ms'] or float('nan'):.1f} ms")
    engine_rss = peak_rss_mb()           # before the probes below allocate their own buffers
    memory = weight_memory(model)
    log(f"peak RSS {engine_rss:.0f} MB; {memory['parameters'] / 1e6:.1f} M parameters held in "
        f"{memory['weight_resident_bytes'] / 1e6:.0f} MB ({memory['bytes_per_parameter']:.2f} bytes per parameter)")
    bw = memory_bandwidth_gbs()
    tflops = matmul_tflops(dtype=model.dtype)
    log(f"memory read bandwidth {bw:.1f} GB/s, dense matmul {tflops * 1e3:.0f} GFLOP/s; "
        f"weights read per step {wbytes / 1e6:.0f} MB")
    summary = []
    for c in concurrencies:
        runs = results[c]
        step_ms = median([x["decode_step_ms"] for x in runs if x["decode_step_ms"]])
        ctx = median([x["mean_context_tokens"] for x in runs if x["mean_context_tokens"]]) or 0
        mem_ms = (wbytes + c * ctx * kv_bytes_per_token) / (bw * 1e9) * 1e3
        compute_ms = c * flops_per_token / (tflops * 1e12) * 1e3
        roofline_ms = max(mem_ms, compute_ms)
        summary.append({"concurrency": c, "output_tok_s": median([x["output_tok_s"] for x in runs]),
                        "decode_step_ms": step_ms, "memory_roofline_ms": mem_ms, "compute_roofline_ms": compute_ms,
                        "roofline_step_ms": roofline_ms, "bound": "memory" if mem_ms >= compute_ms else "compute",
                        "roofline_fraction": roofline_ms / step_ms if step_ms else None, "runs": runs})
    data = {"bench": "offline", "dataset": dataset or "prompts", "dtype": str(model.dtype),
            "machine": machine_info(), "bandwidth_gbs": bw, "matmul_tflops": tflops, "weight_bytes": wbytes,
            "peak_rss_mb": engine_rss, **memory, "results": summary}
    write_json(json_path, data)
    return data
