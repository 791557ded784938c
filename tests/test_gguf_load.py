"""Loading a GGUF model with its blocks (tandem.models.gguf_load): a tensor at a time, float weights
read only where a layer keeps them, and the same function as the float model with the same blocks
attached. The kernel choice (`choose_rows`, timed on the CPU) is fixed here, so the verdicts hold
on any machine."""

from __future__ import annotations

import sys

import pytest
import torch

from tandem.runner.kernels import load_cpu_kernels, make_ops

kernels = load_cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None or not kernels.i8_linear_available(),
                                reason="the 8-bit kernel needs Tandem's CPU kernels on an AVX2 CPU")


@pytest.fixture(scope="module", params=[("llama", "Q4_1"), ("qwen2", "Q8_0")], ids=["llama-q4_1", "qwen2-q8_0"])
def converted(request, tiny_models, tmp_path_factory):
    import gguf

    from tandem.models.gguf_convert import convert_gguf
    from test_gguf import write_gguf

    arch, qtype = request.param
    tmp = tmp_path_factory.mktemp(f"gguf-load-{arch}")
    path = write_gguf(tiny_models[arch], tmp / f"{arch}.gguf", arch, getattr(gguf.GGMLQuantizationType, qtype))
    return convert_gguf(path, tmp / "converted", progress=False), path


def _load(converted, monkeypatch, rows: tuple[int, int]):
    """load_gguf_model with the kernel choice fixed to `rows`; also the float tensors it read."""
    from tandem.models import gguf_load, loader

    reads: list[str] = []
    get = gguf_load.GGUFWeights.get

    def recording(self, name, shape):
        reads.append(name)
        return get(self, name, shape)

    def no_safetensors(*args, **kwargs):
        raise AssertionError("the GGUF path read the converted directory's safetensors")

    monkeypatch.setattr(gguf_load.GGUFWeights, "get", recording)
    monkeypatch.setattr(loader._Weights, "get", no_safetensors)
    monkeypatch.setattr(gguf_load, "choose_rows", lambda layers: rows)
    model_dir, source = converted
    model, _ = gguf_load.load_gguf_model(model_dir, source, torch.float32, 64, make_ops(torch.device("cpu")), "int8")
    monkeypatch.setattr(gguf_load.GGUFWeights, "get", get)
    monkeypatch.undo()
    return model, reads


def test_float_values_from_the_gguf_equal_the_converted_ones(converted):
    """GGUFWeights (dequantized from the file, Q/K rows un-permuted) reads what the converter wrote."""
    import json

    import gguf

    from tandem.models.gguf_load import GGUFWeights
    from tandem.models.loader import _Weights

    model_dir, source = converted
    from_file = GGUFWeights({t.name: t for t in gguf.GGUFReader(str(source)).tensors},
                            json.loads((model_dir / "config.json").read_text()), torch.float32)
    written = _Weights(model_dir, torch.float32)
    assert set(from_file.by_name) == set(written.where)
    for name in written.where:
        want = written.handles[written.where[name]].get_tensor(name)
        assert torch.equal(from_file.get(name, tuple(want.shape)), want), name


def _reference(converted, i8_max_rows: int):
    """The float model (every tensor read) with the GGUF blocks attached to every linear layer."""
    import gguf

    from tandem.models.llama import Linear
    from tandem.models.loader import load_model
    from tandem.models.quant import attach_blocks, gguf_parts, head_tensor

    model_dir, source = converted
    model = load_model(model_dir, torch.float32, torch.device("cpu"), 64)
    tensors = {t.name: t for t in gguf.GGUFReader(str(source)).tensors}
    ops = make_ops(torch.device("cpu"))
    for i, layer in enumerate(model.layers):
        for attr, parts in gguf_parts(model.cfg, i).items():
            assert attach_blocks(getattr(layer, attr), tensors, parts, ops, "int8")
    assert attach_blocks(model.lm_head, tensors, [(head_tensor(tensors), None)], ops, "int8")
    for m in model.modules():
        if isinstance(m, Linear):
            m.quant.max_rows, m.quant.i8_max_rows = 0, i8_max_rows
    return model


def _hidden_and_logits(model, ids: torch.Tensor):
    """The model's first layers' input (the embedding rows) and its logits, attention-free: one
    token per position 0 (no KV needed beyond a throwaway cache)."""
    from tandem.runner.attention import AttentionBackend, PagedKVCache
    from tandem.runner.inputs import build_inputs
    from tandem.types import ScheduledSeq, StepPlan
    from tandem.sampling_params import SamplingParams

    cfg = model.cfg
    model.ops = make_ops(torch.device("cpu"))
    cache = PagedKVCache(cfg.num_layers, 8, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32, torch.device("cpu"))
    attn = AttentionBackend(cache, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, model.ops)
    seq = ScheduledSeq("r", ids.tolist(), 0, [0, 1], True, SamplingParams(), 0, ())
    inputs = build_inputs(StepPlan([seq]), 16, torch.device("cpu"), attn.kernel is not None)
    hidden = model(inputs.input_ids, inputs.positions, attn, inputs.meta)
    return model.compute_logits(hidden)


def test_int8_everywhere_reads_one_float_tensor_per_shape_and_keeps_none(converted, monkeypatch):
    from tandem.models.llama import Linear

    model, reads = _load(converted, monkeypatch, (0, sys.maxsize))
    linear_weights = [n for n in reads if n.endswith("_proj.weight") or n in ("lm_head.weight",
                                                                               "model.embed_tokens.weight")]
    # the probe: the first layer of each weight shape (q/k/v and gate/up are fused), then the LM head
    shapes = {("q", "k", "v"), ("o",), ("gate", "up"), ("down",)}
    assert all(".layers.0." in n for n in linear_weights[:-1]), linear_weights
    assert len(linear_weights) == sum(len(s) for s in shapes) + 1
    assert linear_weights[-1] in ("lm_head.weight", "model.embed_tokens.weight")
    assert not any("embed_tokens" in n for n in reads[:-1] if n in linear_weights[:-1])
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    assert all(m.float_released and m.weight.numel() == 0 and m._panels is None and m._packed is None
               for m in layers)
    assert model.embed.numel() == 0                                     # lookups read the GGUF rows
    ids = torch.tensor([3, 5, 7, 11, 13, 2])
    ref = _reference(converted, sys.maxsize)
    assert torch.equal(model.embed_table.rows(ids), ref.embed[ids])
    assert torch.equal(model.head_rows(ids), ref.head_rows(ids))
    assert torch.equal(_hidden_and_logits(model, ids), _hidden_and_logits(ref, ids))


def test_bounded_int8_keeps_float_weights_for_large_steps(converted, monkeypatch):
    from tandem.models.llama import Linear

    model, reads = _load(converted, monkeypatch, (0, 2))
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    assert all(m.quant is not None and not m.float_released and m.quant.i8_max_rows == 2 for m in layers)
    assert all(m._panels is not None or m._packed is not None or m.weight.numel() for m in layers)
    ref = _reference(converted, 2)
    for ids in (torch.tensor([3, 5]), torch.tensor([3, 5, 7, 11, 13, 2, 9, 4])):   # the 8-bit kernel, then dense
        assert torch.equal(_hidden_and_logits(model, ids), _hidden_and_logits(ref, ids))


def test_the_fused_decoder_stack_gives_the_python_layer_loop_bit_for_bit(converted, monkeypatch):
    """A decode step through csrc/decoder_stack.cpp (one C++ call for all layers) computes exactly
    what LlamaModel.forward's Python loop computes, hidden states and KV writes alike; a model it
    does not fit (Qwen2's q/k/v bias) keeps the Python loop."""
    model, _ = _load(converted, monkeypatch, (0, sys.maxsize))
    assert_stack_matches_python_loop(model)


def assert_stack_matches_python_loop(model) -> None:
    """`model` (every layer on the 8-bit kernel at every size): decode steps through the decoder
    stack equal the Python loop's, bit for bit, and so do the KV caches they write."""
    from tandem.runner.attention import AttentionBackend, PagedKVCache
    from tandem.runner.passes import ForwardPass
    from tandem.sampling_params import SamplingParams
    from tandem.types import ScheduledSeq

    cfg = model.cfg
    model.ops = make_ops(torch.device("cpu"))
    caches = [PagedKVCache(cfg.num_layers, 8, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32, torch.device("cpu"))
              for _ in range(2)]
    passes = [ForwardPass(model, AttentionBackend(c, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, model.ops),
                          16, torch.device("cpu")) for c in caches]
    if cfg.qkv_bias:
        assert passes[0].stack is None
        return
    assert passes[0].stack is not None and passes[0].stack.max_rows == sys.maxsize
    passes[1].fused = False
    sp = SamplingParams()
    prompts = {"a": [3, 5, 7, 11, 13, 2, 9], "b": [4, 6, 8]}
    blocks = {"a": [0, 1], "b": [2, 3]}
    for p in passes:                          # the prompts: a prefill step, never fused
        p.run(p.inputs([ScheduledSeq(r, ids, 0, blocks[r], True, sp, 0, ()) for r, ids in prompts.items()]))
    for step in range(3):                     # decode steps of two rows, then one
        seqs = [ScheduledSeq("a", [17 + step], 7 + step, blocks["a"], True, sp, step, ())]
        if step < 2:
            seqs.append(ScheduledSeq("b", [19 + step], 3 + step, blocks["b"], True, sp, step, ()))
        fused, plain = (p.run(p.inputs(seqs)) for p in passes)
        assert passes[0].stack.applies(passes[0].inputs(seqs).meta, len(seqs))
        assert torch.equal(fused, plain), step
    for kf, kp, vf, vp in zip(caches[0].k, caches[1].k, caches[0].v, caches[1].v):
        assert torch.equal(kf, kp) and torch.equal(vf, vp)


def test_a_gguf_model_gets_float_weights_only_when_a_float_load_asks(converted, tmp_path, monkeypatch):
    from tandem.models import fetch
    from tandem.models.gguf_convert import ensure_float_weights

    model_dir, source = converted
    monkeypatch.setattr(fetch, "cache_dir", lambda: tmp_path)
    d = fetch.resolve_model(str(source), progress=False)
    assert (d / "config.json").is_file() and (d / "tokenizer.json").is_file()
    assert not list(d.glob("*.safetensors"))                       # the GGUF path reads the file itself
    ensure_float_weights(d, progress=False)
    assert (d / "model.safetensors").read_bytes() == (model_dir / "model.safetensors").read_bytes()


def test_a_large_lm_head_takes_the_verdict_of_its_input_width_unprobed(converted, monkeypatch):
    from tandem.models import gguf_load

    monkeypatch.setattr(gguf_load, "LARGE_HEAD_BYTES", 0)          # every head counts as large
    model, reads = _load(converted, monkeypatch, (2, sys.maxsize))
    assert not any(n in ("lm_head.weight", "model.embed_tokens.weight") for n in reads)
    assert model.lm_head.quant.i8_max_rows == sys.maxsize and model.lm_head.float_released


def test_a_float_load_of_a_gguf_writes_its_float_weights_first(converted, tmp_path, monkeypatch):
    from tandem.llm import load_weights
    from tandem.models import fetch

    model_dir, source = converted
    monkeypatch.setattr(fetch, "cache_dir", lambda: tmp_path)
    d = fetch.resolve_model(str(source), progress=False)
    model, how = load_weights(d, torch.float32, torch.device("cpu"), 64, "none")
    assert how == "float"
    assert (d / "model.safetensors").read_bytes() == (model_dir / "model.safetensors").read_bytes()


def test_a_model_whose_float_copies_exceed_the_budget_holds_none(converted, monkeypatch):
    """Past the float-copy budget (an 8B shape in bfloat16 on a 24 GiB machine) no layer is probed
    and none holds float weights: the 8-bit kernel serves every step size, as it computes them."""
    from tandem.models import gguf_load
    from tandem.models.llama import Linear

    def no_probe(layers):
        raise AssertionError("a layer was probed for float weights past the budget")

    monkeypatch.setattr(gguf_load, "float_copy_budget", lambda file_bytes: 0)
    monkeypatch.setattr(gguf_load, "choose_rows", no_probe)
    model_dir, source = converted
    model, described = gguf_load.load_gguf_model(model_dir, source, torch.float32, 64, make_ops(torch.device("cpu")),
                                                 "int8")
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.float_released and m.quant.i8_max_rows == sys.maxsize for m in linears)
    assert f"{len(linears)} on the 8-bit kernel at every step size" in described
    monkeypatch.undo()
    want = _hidden_and_logits(_reference(converted, sys.maxsize), torch.tensor([3, 5, 7]))
    assert torch.equal(_hidden_and_logits(model, torch.tensor([3, 5, 7])), want)


def test_the_float_copy_budget_is_a_share_of_the_memory_beside_the_blocks(monkeypatch):
    from tandem.models import gguf_load
    from tandem.runner import device

    monkeypatch.setattr(device, "available_memory_bytes", lambda d: 22 * 10**9)
    assert gguf_load.float_copy_budget(4 * 10**9) == int(gguf_load.FLOAT_COPY_SHARE * 18 * 10**9)
    assert gguf_load.float_copy_budget(30 * 10**9) == 0
