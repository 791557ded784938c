"""Load a model converted from a GGUF file with its weights kept quantized, one tensor at a time.

The converted directory (tandem.models.gguf_convert) holds the config and the tokenizer (and,
for some, the float32 values of every tensor, which this path does not read); the GGUF file holds
the blocks. Each linear layer gets its blocks
straight from the file (`quant.attach_blocks`); the first layer of each weight shape also loads its
float weights and times the kernels on this CPU (`quant.choose_rows`), and that decides the whole
shape: where the 8-bit kernel serves every step size (prefill included) no layer of the shape ever
holds float weights again; elsewhere each layer reads its
float weights too, as the dense path needs them for large steps. The token embedding is looked up
from the file's rows (`quant.RowTable`), never expanded to a float table. So the load holds at
most one float32 tensor (and its packed copy, while it is timed) beyond what the model keeps: a 7B
Q4 file needs its ~4 GB of blocks, not the ~28 GB of float32 the directory describes.

Float values (norms, biases, the probes, layers without a kernel) are dequantized from the GGUF
itself a tensor at a time (`GGUFWeights`), so the directory needs no model.safetensors: a GGUF
converted for this path (tandem.models.fetch) holds config and tokenizer only, and gets its float
weights written the first time a float load asks for them (`ensure_float_weights`). An LM head
whose float copy would be large (LARGE_HEAD_BYTES: a 128k vocabulary) is not probed: it takes the
verdict of the widest probed layer with the same input width. Float copies of the linear layers
are kept only where all of them fit a budget (`float_copy_budget`: half the memory free beside the
file's blocks); a model too large for that, such as an 8B shape on a 24 GiB machine with bfloat16,
holds its blocks alone and runs the 8-bit kernel at every step size.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import numpy as np
import torch

from tandem.errors import ModelLoadError
from tandem.models.gguf_convert import release_pages
from tandem.models.llama import Linear, LlamaModel
from tandem.models.loader import fill_linear, fill_norms, linear_parts, load_arch
from tandem.models.quant import (RowTable, attach_blocks, choose_rows, gguf_parts, head_tensor, release_layer,
                                 release_shadowed_blocks)

log = logging.getLogger("tandem.quant")


def load_gguf_model(model_dir: Path, source: Path, dtype: torch.dtype, max_positions: int, ops,
                    activations: str) -> tuple[LlamaModel, str]:
    """The model of `model_dir` on CPU, its linear layers on the blocks of `source` (the GGUF it
    was converted from); returns it with a description for the log. `activations`: "int8"
    (llama.cpp's arithmetic) or "float" (the float32 function, up to summation order)."""
    import gguf

    arch = load_arch(model_dir)
    try:
        reader = gguf.GGUFReader(str(source))
        tensors = {t.name: t for t in reader.tensors}
    except Exception as e:  # the reader raises ValueError, IndexError, struct errors... on damage
        raise ModelLoadError(f"corrupt or truncated GGUF file {source}: {e}") from e
    w = GGUFWeights(tensors, json.loads((model_dir / "config.json").read_text()), dtype)
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"GGUF file {source} has no token_embd.weight")
    model = LlamaModel(arch, dtype, max_positions)
    for m in model.modules():                      # nothing float is read unless a layer needs it
        if isinstance(m, Linear):
            m.weight.data = torch.empty(0, dtype=dtype)
    model.embed.data = torch.empty(0, dtype=dtype)
    model.norm.data = w.get("model.norm.weight", (arch.hidden_size,))
    model.embed_table = RowTable(tensors["token_embd.weight"], dtype)
    model.head_table = RowTable(tensors[head_tensor(tensors)], dtype)
    float_bytes = dtype.itemsize * sum(int(tensors[name].n_elements) for i in range(arch.num_layers)
                                       for parts in gguf_parts(arch, i).values() for name, _ in parts if name in tensors)
    float_bytes += dtype.itemsize * int(tensors[head_tensor(tensors)].n_elements)
    budget = float_copy_budget(source.stat().st_size)
    loader = _LinearLoader(tensors, w, ops, activations, float_copies=float_bytes <= budget)
    if not loader.float_copies:
        log.info("no float copies of the linear layers: they would take %.1f GB, over the %.1f GB budget "
                 "(FLOAT_COPY_SHARE of the memory free beside the file's blocks); the 8-bit kernel serves "
                 "every step size", float_bytes / 1e9, budget / 1e9)
    for i, layer in enumerate(model.layers):
        fill_norms(layer, i, arch, w)
        hf = linear_parts(arch, i)
        for attr, parts in gguf_parts(arch, i).items():
            loader.load(getattr(layer, attr), parts, hf[attr])
        release_pages(reader)   # the file's pages this layer read: its blocks are copied into the model
    if not arch.tie_word_embeddings:
        head_hf = [("lm_head.weight", (arch.vocab_size, arch.hidden_size))]
    else:
        head_hf = [("model.embed_tokens.weight", (arch.vocab_size, arch.hidden_size))]
        model.lm_head.weight = torch.nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)   # untied
    loader.load(model.lm_head, [(head_tensor(tensors), None)], head_hf)
    release_pages(reader)
    model.eval()
    return model, loader.describe()


LARGE_HEAD_BYTES = 2**29     # an LM head whose float32 copy is larger is not probed (see the module docstring)
FLOAT_COPY_SHARE = 0.5       # float copies of the linear layers may take this share of the memory beside the blocks


def float_copy_budget(file_bytes: int) -> int:
    """Bytes the linear layers' float copies (the dense path of large steps, where the 8-bit kernel
    does not win them) may take: FLOAT_COPY_SHARE of the memory free now less the file's blocks,
    so that the blocks, the copies and the KV cache (sized from the memory free before the load)
    fit together. A model whose copies would not fit holds none."""
    from tandem.runner.device import available_memory_bytes

    return int(FLOAT_COPY_SHARE * max(0, available_memory_bytes(torch.device("cpu")) - file_bytes))


class GGUFWeights:
    """The float values of a GGUF's tensors by their Hugging Face names, dequantized when asked
    for, Q/K rows un-permuted, as the converter writes them (`get` and `cat`, as loader._Weights)."""

    def __init__(self, tensors: dict, cfg: dict, dtype: torch.dtype) -> None:
        from tandem.models.gguf_convert import hf_name

        self.cfg, self.dtype = cfg, dtype
        self.by_name = {hf_name(n): t for n, t in tensors.items() if hf_name(n) is not None}

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        from tandem.models.gguf_convert import float_slabs

        t = self.by_name.get(name)
        if t is None:
            raise ModelLoadError(f"weight {name!r} is missing from the GGUF file")
        have = tuple(int(d) for d in reversed(t.shape.tolist()))
        if have != shape:
            raise ModelLoadError(f"weight {name!r} has shape {have}, expected {shape}")
        try:
            values = np.concatenate(list(float_slabs(t, name, shape, self.cfg)), axis=0).reshape(shape)
        except (ValueError, IndexError, TypeError) as e:
            raise ModelLoadError(f"corrupt GGUF tensor data ({t.name}): {e}") from e
        return torch.from_numpy(values).to(self.dtype, copy=True)

    def cat(self, names: list[str], shapes: list[tuple[int, ...]]) -> torch.Tensor:
        return torch.cat([self.get(n, s) for n, s in zip(names, shapes)], dim=0)


class _LinearLoader:
    def __init__(self, tensors: dict, w: GGUFWeights, ops, activations: str, float_copies: bool = True) -> None:
        """`float_copies` False: a layer with the 8-bit kernel takes it at every step size, unprobed,
        and never holds float weights (the model's copies would not fit in memory)."""
        self.tensors, self.w, self.ops, self.activations = tensors, w, ops, activations
        self.float_copies = float_copies
        self.rows: dict[tuple[int, int], tuple[int, int]] = {}     # shape -> (max_rows, i8_max_rows)
        self.num_quantized = self.num_i8 = self.num_float = 0

    def load(self, linear: Linear, parts: list[tuple[str, int | None]], hf_parts: list) -> None:
        if not attach_blocks(linear, self.tensors, parts, self.ops, self.activations, weight_only=self.float_copies):
            self._dense(linear, hf_parts)                  # a type without a kernel: float weights
            self.num_float += 1
            return
        self.num_quantized += 1
        shape = (linear.out_features, linear.in_features)
        probe = shape not in self.rows
        if probe and not self.float_copies and linear.quant.i8 is not None:
            self.rows[shape] = (0, sys.maxsize)
            probe = False
        if probe and 4 * linear.out_features * linear.in_features > LARGE_HEAD_BYTES:
            same_k = [s for s in self.rows if s[1] == linear.in_features]
            if same_k:
                self.rows[shape] = self.rows[max(same_k)]
                probe = False
        if probe:
            self._dense(linear, hf_parts)
            self.rows[shape] = choose_rows([linear])
            log.info("quantized kernels for %s: weight-only up to %d rows, 8-bit up to %s", shape,
                     self.rows[shape][0], "any number of" if self.rows[shape][1] == sys.maxsize else self.rows[shape][1])
        linear.quant.max_rows, linear.quant.i8_max_rows = self.rows[shape]
        if linear.quant.i8 is not None and linear.quant.i8_max_rows == sys.maxsize:
            self.num_i8 += 1
            release_layer(linear)
            if not probe and linear.bias is not None:
                fill_linear(linear, hf_parts, self.w, weight=False)
        else:
            release_shadowed_blocks(linear)
            if not probe:
                self._dense(linear, hf_parts)

    def _dense(self, linear: Linear, hf_parts: list) -> None:
        fill_linear(linear, hf_parts, self.w)
        linear.prepack()

    def describe(self) -> str:
        rows = [r for r, _ in self.rows.values()]
        return (f"GGUF blocks in {self.num_quantized} linear layers, loaded a tensor at a time "
                f"(weight-only kernel up to {min(rows, default=0)} rows; {self.num_i8} on the 8-bit kernel at "
                f"every step size, holding no float weights; {self.num_quantized - self.num_i8} with float weights too; "
                f"{self.num_float} float only)")
