"""--generation-config auto|vllm|FOLDER: the model's generation_config.json sampling fields become the
defaults of requests that omit them (server and LLM.generate), as in vLLM; a request's own value
always wins. The default model, in a copy with a generation_config.json (its weights symlinked)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from tandem.errors import ConfigError, ModelLoadError
from tandem.models.generation_config import generation_defaults
from tandem.sampling_params import SamplingParams

GEN = {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20,
       "min_p": 0.05, "repetition_penalty": 1.1, "max_new_tokens": 77}
DEFAULTS = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
            "max_tokens": 77}


def model_copy(model_dir: Path, out: Path, gen: dict | None) -> Path:
    """`model_dir` with its weights symlinked and its small files copied, plus a generation_config.json."""
    out.mkdir(parents=True)
    for f in model_dir.iterdir():
        if f.suffix == ".safetensors":
            (out / f.name).symlink_to(f.resolve())
        elif f.is_file():
            shutil.copy(f, out / f.name)
    if gen is not None:
        (out / "generation_config.json").write_text(json.dumps(gen))
    return out


@pytest.fixture(scope="module")
def gen_model(default_model_dir, tmp_path_factory) -> Path:
    return model_copy(default_model_dir, tmp_path_factory.mktemp("gen") / "SmolLM2-gen", GEN)


def test_defaults_from_the_file(gen_model, tmp_path):
    assert generation_defaults("auto", gen_model) == DEFAULTS
    assert generation_defaults("vllm", gen_model) == {}
    # a folder: its generation_config.json, whatever the model's
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.2, "top_k": 0}))
    assert generation_defaults(str(other), gen_model) == {"temperature": 0.2, "top_k": -1}   # HF's 0: off
    # no file: no defaults (auto); a folder without one, or no folder: a ConfigError
    assert generation_defaults("auto", tmp_path) == {}
    with pytest.raises(ConfigError, match="has no generation_config.json"):
        generation_defaults(str(tmp_path), gen_model)
    with pytest.raises(ConfigError, match="is not a folder"):
        generation_defaults(str(tmp_path / "nope"), gen_model)


def test_bad_values_name_the_file(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0.0}))
    with pytest.raises(ModelLoadError, match="generation_config.json.*top_p"):
        generation_defaults("auto", tmp_path)
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot read"):
        generation_defaults("auto", tmp_path)


@pytest.fixture(scope="module")
def gen_llm(gen_model):
    from tandem import LLM

    return LLM(model=str(gen_model), dtype="float32", progress=False, quantization="none", max_model_len=512,
               kv_cache_memory_gb=0.05)


def test_startup_logs_the_applied_defaults_once(gen_model, caplog):
    from tandem import LLM

    with caplog.at_level(logging.WARNING, logger="tandem"):
        llm = LLM(model=str(gen_model), dtype="float32", progress=False, quantization="none", max_model_len=256,
                  kv_cache_memory_gb=0.02)
    msgs = [r.getMessage() for r in caplog.records if "default sampling parameters" in r.getMessage()]
    assert len(msgs) == 1 and "generation_config.json" in msgs[0] and "'temperature': 0.6" in msgs[0]
    assert "--generation-config vllm" in msgs[0]
    assert llm.engine.generation_defaults == DEFAULTS


def test_server_requests_get_the_model_defaults_unless_they_say_otherwise(gen_llm):
    from tandem.engine.async_engine import AsyncLLMEngine
    from tandem.server.app import create_app
    from tandem.server.protocol import ChatCompletionRequest, CompletionRequest
    from tandem.server.serving_chat import prepare_chat
    from tandem.server.serving_completion import prepare_completion

    engine = AsyncLLMEngine(gen_llm.engine)
    try:
        state = create_app(engine, "m").state.tandem
        msgs = [{"role": "user", "content": "Hi"}]
        p = prepare_chat(state, ChatCompletionRequest(messages=msgs)).params[0]
        assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_tokens) == \
            (0.6, 0.9, 20, 0.05, 1.1, 77)
        assert (p.presence_penalty, p.frequency_penalty) == (0.0, 0.0)        # the file gives none
        explicit = ChatCompletionRequest(messages=msgs, temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0,
                                         repetition_penalty=1.0, max_tokens=5)
        q = prepare_chat(state, explicit).params[0]
        assert (q.temperature, q.top_p, q.top_k, q.min_p, q.repetition_penalty, q.max_tokens) == \
            (0.0, 1.0, -1, 0.0, 1.0, 5)
        only_t = prepare_chat(state, ChatCompletionRequest(messages=msgs, temperature=1.3, top_k=0)).params[0]
        assert (only_t.temperature, only_t.top_k, only_t.top_p) == (1.3, -1, 0.9)   # top_k 0: off, explicitly
        c = prepare_completion(state, CompletionRequest(prompt="Hello")).params[0]
        assert (c.temperature, c.top_k, c.max_tokens) == (0.6, 20, 77)            # 77, not /v1/completions' 16
        c2 = prepare_completion(state, CompletionRequest(prompt="Hello", max_tokens=3, temperature=0.1)).params[0]
        assert (c2.temperature, c2.top_k, c2.max_tokens) == (0.1, 20, 3)
    finally:
        engine.shutdown()


def test_llm_generate_without_params_uses_the_model_defaults(gen_llm, monkeypatch):
    seen: list[SamplingParams] = []

    class Stop(Exception):
        pass

    def validate(prompt, ids, params):
        seen.append(params)
        raise Stop

    monkeypatch.setattr(gen_llm.engine, "validate", validate)
    for call in (lambda: gen_llm.generate("Hello"), lambda: gen_llm.chat([{"role": "user", "content": "Hi"}])):
        with pytest.raises(Stop):
            call()
    for p in seen:
        assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_tokens) == \
            (0.6, 0.9, 20, 0.05, 1.1, 77)
    with pytest.raises(Stop):       # given params are used as they are
        gen_llm.generate("Hello", SamplingParams(max_tokens=4))
    assert seen[-1].temperature == 1.0 and seen[-1].max_tokens == 4 and seen[-1].top_k == -1


def test_generation_config_flag_reaches_the_llm(monkeypatch):
    import tandem.llm
    from tandem.cli import build_parser, make_llm

    got = {}
    monkeypatch.setattr(tandem.llm, "LLM", lambda **kw: got.update(kw))
    for argv, want in ((["generate", "x"], "auto"), (["generate", "x", "--generation-config", "vllm"], "vllm"),
                       (["serve", "--generation-config", "/some/folder"], "/some/folder")):
        make_llm(build_parser().parse_args(argv))
        assert got["generation_config"] == want
