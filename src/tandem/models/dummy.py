"""Random weights for any supported architecture, from its config.json alone: vLLM's
`--load-format dummy`. Speed does not depend on the weights' values, so a dummy model measures
what a real one of that shape would cost: its weight bytes, GEMM shapes, KV per token and LM head.

Linear and embedding weights are drawn from N(0, initializer_range) (the config's, 0.02 if it has
none), norms are ones and biases zeros, from a generator seeded by `seed`, so two loads give the
same model. Layers are filled one at a time and prepacked like loaded ones (tandem.models.loader).
"""

from __future__ import annotations

from pathlib import Path

import torch

from tandem.models.llama import LlamaModel
from tandem.models.loader import build_model, load_arch


def load_dummy_model(model_dir: Path, dtype: torch.dtype, device: torch.device, max_positions: int,
                     seed: int = 0, prepack: bool = True) -> LlamaModel:
    arch = load_arch(model_dir)
    std = float(getattr(arch.hf_config, "initializer_range", None) or 0.02)
    gen = torch.Generator().manual_seed(seed)

    def fill(name: str, p: torch.Tensor) -> None:
        if "norm" in name:
            p.data.fill_(1.0)
        elif name.endswith("bias"):
            p.data.zero_()
        else:
            p.data.normal_(0.0, std, generator=gen)

    def fill_globals(model: LlamaModel) -> None:
        fill("embed", model.embed)
        fill("norm", model.norm)
        if not arch.tie_word_embeddings:
            fill("lm_head.weight", model.lm_head.weight)

    def fill_layer(layer, i: int) -> None:
        for name, p in layer.named_parameters():
            fill(name, p)

    return build_model(arch, dtype, device, max_positions, fill_globals, fill_layer, prepack)
