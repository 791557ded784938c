"""dtype="auto" on CPUs: bf16 exactly where the CPU computes it natively, whatever torch reports."""

from __future__ import annotations

import types

import pytest
import torch

from tandem.errors import ConfigError
from tandem.runner import device


@pytest.mark.parametrize("flags, fast", [
    ("fpu sse avx2 fma avx512f avx512bw", False),      # AVX-512 without BF16: bf16 is converted in software
    ("fpu avx2 avx512f avx512_bf16 avx512_vnni", True),
    ("fpu avx2 avx512f amx_bf16 amx_tile", True),
    ("fpu avx2 fma", False),
    ("", False),                                        # no /proc/cpuinfo
])
def test_auto_dtype_follows_the_cpu_flags(monkeypatch, flags, fast):
    monkeypatch.setattr(torch._C, "_cpu", types.SimpleNamespace())   # as in torch 2.13: no bf16 query
    monkeypatch.setattr(device, "cpu_info", lambda: {"flags": flags})
    assert device.cpu_has_fast_bf16() is fast
    assert device.resolve_dtype("auto", torch.device("cpu")) == (torch.bfloat16 if fast else torch.float32)
    assert device.resolve_dtype("float32", torch.device("cpu")) == torch.float32


def test_torch_query_wins_where_it_exists(monkeypatch):
    monkeypatch.setattr(torch._C, "_cpu", types.SimpleNamespace(_is_avx512_bf16_supported=lambda: True))
    monkeypatch.setattr(device, "cpu_info", lambda: {"flags": "avx2"})
    assert device.cpu_has_fast_bf16()


def test_unknown_dtype_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown dtype"):
        device.resolve_dtype("bf17", torch.device("cpu"))
