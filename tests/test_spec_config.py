"""vLLM's `--speculative-config` JSON maps onto SpecConfig; bad configs are ConfigErrors naming the key."""

from __future__ import annotations

import pytest

from tandem.cli import build_parser
from tandem.cli_engine import spec_config_from_args
from tandem.config import SpecConfig
from tandem.errors import ConfigError


@pytest.mark.parametrize("spec,expected", [
    ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 2},
     SpecConfig(method="ngram", max_draft_tokens=4, ngram_min=2, ngram_max=3)),
    ({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 6},
     SpecConfig(method="ngram", max_draft_tokens=5, ngram_min=6, ngram_max=6)),
    ({"model": "/d.gguf", "num_speculative_tokens": 5}, SpecConfig(method="draft", draft_model="/d.gguf",
                                                                   max_draft_tokens=5)),
    ({"method": "draft_model", "model": "/d", "policy": "fixed", "frontier_size": 2},
     SpecConfig(method="draft", draft_model="/d", policy="fixed", frontier_size=2)),
    ({"model": "/d.gguf", "quantization": "none"}, SpecConfig(method="draft", draft_model="/d.gguf",
                                                              draft_quantization="none")),
    ({"method": "layerskip", "num_draft_layers": 6}, SpecConfig(method="layerskip", num_draft_layers=6)),
    ({"method": "ngram", "length_table": [[1, 4], [8, 2]]}, SpecConfig(length_table=((1, 4), (8, 2)))),
    ({}, SpecConfig()),
    ({"method": "suffix"}, SpecConfig(method="suffix", max_draft_tokens=24)),
    ({"method": "suffix", "suffix_decoding_max_tree_depth": 40},
     SpecConfig(method="suffix", max_draft_tokens=32, suffix_decoding_max_tree_depth=40)),
    ({"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_min_token_prob": 0.2,
      "suffix_decoding_max_cached_requests": 0, "suffix_decoding_max_spec_factor": 2.0},
     SpecConfig(method="suffix", max_draft_tokens=8, suffix_decoding_min_token_prob=0.2,
                suffix_decoding_max_cached_requests=0, suffix_decoding_max_spec_factor=2.0)),
])
def test_vllm_speculative_config_maps_onto_spec_config(spec, expected):
    assert SpecConfig.from_vllm(spec) == expected
    import json

    assert SpecConfig.from_vllm(json.dumps(spec)) == expected


@pytest.mark.parametrize("spec,words", [
    ("{not json", "not JSON"),
    ("[1, 2]", "JSON object"),
    ({"method": "eagle", "model": "x"}, "'eagle' is not supported"),
    ({"method": "ngram", "num_speculative_token": 4}, "unknown speculative config key 'num_speculative_token'"),
    ({"num_speculative_tokens": 0}, "max_draft_tokens must be in [1, 32]"),
    ({"num_speculative_tokens": "4"}, "wrong value type"),
    ({"method": "draft_model"}, "needs draft_model"),
    ({"model": "/d.gguf", "quantization": "awq"}, "unknown draft_quantization 'awq'"),
])
def test_bad_speculative_config_is_a_config_error(spec, words):
    with pytest.raises(ConfigError, match=None) as e:
        SpecConfig.from_vllm(spec)
    assert words in str(e.value)


def test_cli_flag_and_conflict():
    a = build_parser().parse_args(["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert spec_config_from_args(a) == SpecConfig(method="ngram", max_draft_tokens=3)
    a = build_parser().parse_args(["serve", "--speculative", "ngram", "--speculative-config", "{}"])
    with pytest.raises(ConfigError, match="not both"):
        spec_config_from_args(a)
    assert spec_config_from_args(build_parser().parse_args(["serve"])) is None
