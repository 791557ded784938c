"""--model org/name[@revision]: Hugging Face Hub repository ids, resolved by huggingface_hub into the
standard HF cache. The Hub is unreachable here, so the tests build caches laid out exactly as
huggingface_hub lays them out (models--org--name/refs/<ref>, snapshots/<commit>/<file> linking to
blobs/, or plain files) and run with HF_HUB_OFFLINE=1, or against a Hub endpoint that refuses."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from tandem.errors import ModelLoadError
from tandem.models.fetch import parse_hub_id, resolve_model

COMMIT_A = "a" * 40
COMMIT_B = "b" * 40
REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"


def hf_cache(cache: Path, repo: str, snapshots: dict[str, Path], refs: dict[str, str], blobs: bool = True) -> Path:
    """Lay out `repo` in the HF cache `cache`: each snapshot commit gets the files of a model
    directory, as relative symlinks into blobs/ (huggingface_hub's layout; large weights are
    symlinked from the blob to the source file to save the copy) or as plain files."""
    root = cache / f"models--{repo.replace('/', '--')}"
    for ref, commit in refs.items():
        (root / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (root / "refs" / ref).write_text(commit)          # no newline, as huggingface_hub writes it
    for commit, src in snapshots.items():
        snap = root / "snapshots" / commit
        snap.mkdir(parents=True)
        for f in sorted(src.iterdir()):
            if not f.is_file():
                continue
            if not blobs:
                shutil.copy(f, snap / f.name)
                continue
            big = f.stat().st_size > 2**20
            key = hashlib.sha256(f"{f.resolve()}:{f.stat().st_size}".encode() if big else f.read_bytes()).hexdigest()
            blob = root / "blobs" / key
            blob.parent.mkdir(parents=True, exist_ok=True)
            if not blob.exists():
                blob.symlink_to(f.resolve()) if big else shutil.copy(f, blob)
            (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    return root


@pytest.fixture
def offline(monkeypatch, tmp_path) -> Path:
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


def test_hub_ids_are_recognised():
    assert parse_hub_id("org/name") == ("org/name", None, None)
    assert parse_hub_id("org/name@v1.0") == ("org/name", None, "v1.0")
    assert parse_hub_id("org/name@refs/pr/3") == ("org/name", None, "refs/pr/3")
    assert parse_hub_id("org/name-GGUF/model.Q4_1.gguf@main") == ("org/name-GGUF", "model.Q4_1.gguf", "main")
    for not_an_id in ("name", "./org/name", "/abs/path", "a/b/c", "org--x/name", "org/na..me", "models/x.gguf", ""):
        assert parse_hub_id(not_an_id) is None, not_an_id


def test_offline_hub_id_resolves_to_the_cached_snapshot(default_model_dir, offline):
    from tandem.engine.tokenizer import Tokenizer
    from tandem.models.loader import load_arch

    hf_cache(offline, REPO, {COMMIT_A: default_model_dir}, {"main": COMMIT_A})
    got = resolve_model(REPO, progress=False)
    assert got == offline / "models--HuggingFaceTB--SmolLM2-135M-Instruct" / "snapshots" / COMMIT_A
    assert load_arch(got).num_layers == 30 and Tokenizer(got).vocab_size == 49152
    assert (got / "model.safetensors").read_bytes()[:64] == (default_model_dir / "model.safetensors").read_bytes()[:64]


def test_hf_home_is_respected(default_model_dir, offline, monkeypatch, tmp_path):
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hfhome"))
    hf_cache(tmp_path / "hfhome" / "hub", REPO, {COMMIT_A: default_model_dir}, {"main": COMMIT_A}, blobs=False)
    assert resolve_model(REPO, progress=False) == (tmp_path / "hfhome" / "hub" / "models--HuggingFaceTB--"
                                                   "SmolLM2-135M-Instruct" / "snapshots" / COMMIT_A)


def test_revision_selects_another_snapshot(default_model_dir, offline, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(default_model_dir, other, ignore=shutil.ignore_patterns("*.safetensors"))
    (other / "model.safetensors").symlink_to(default_model_dir / "model.safetensors")
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.3}))
    root = hf_cache(offline, REPO, {COMMIT_A: default_model_dir, COMMIT_B: other}, {"main": COMMIT_A, "v2": COMMIT_B})
    assert resolve_model(REPO, progress=False) == root / "snapshots" / COMMIT_A
    assert resolve_model(REPO + "@main", progress=False) == root / "snapshots" / COMMIT_A
    b = resolve_model(REPO + "@v2", progress=False)                     # a tag (or branch) ref
    assert b == root / "snapshots" / COMMIT_B and (b / "generation_config.json").is_file()
    assert resolve_model(f"{REPO}@{COMMIT_B}", progress=False) == b      # a commit hash
    with pytest.raises(ModelLoadError, match="not in the cache.*HF_HUB_OFFLINE=1") as e:
        resolve_model(REPO + "@v3", progress=False)
    assert "--revision v3" in str(e.value)


def test_missing_model_says_what_was_tried_and_how_to_fix_it(offline):
    with pytest.raises(ModelLoadError) as e:
        resolve_model("nobody/no-such-model", progress=False)
    msg = str(e.value)
    assert "not a local path" in msg and "Hugging Face Hub" in msg and str(offline) in msg
    assert "HF_HUB_OFFLINE=1" in msg and "hf download nobody/no-such-model" in msg
    with pytest.raises(ModelLoadError, match="not found: give a Hugging Face model directory"):
        resolve_model("./nobody/no-such-model", progress=False)      # a path, not an id: no Hub look-up


def test_unreachable_hub_falls_back_to_the_cache(default_model_dir, offline, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")   # refuses connections
    root = hf_cache(offline, REPO, {COMMIT_A: default_model_dir}, {"main": COMMIT_A})
    assert resolve_model(REPO, progress=False) == root / "snapshots" / COMMIT_A
    with pytest.raises(ModelLoadError, match="could not be reached.*ConnectError"):
        resolve_model("nobody/no-such-model", progress=False)


def test_snapshot_without_weights_is_a_clear_error(default_model_dir, offline, tmp_path):
    partial = tmp_path / "partial"
    partial.mkdir()
    shutil.copy(default_model_dir / "config.json", partial)
    hf_cache(offline, "org/partial", {COMMIT_A: partial}, {"main": COMMIT_A})
    with pytest.raises(ModelLoadError, match="needs config.json and \\*.safetensors.*config.json"):
        resolve_model("org/partial", progress=False)


def test_llm_on_a_hub_id_is_the_local_model(tiny_llama, offline):
    from tandem import LLM, SamplingParams
    from tandem.cli import served_model_name

    hf_cache(offline, "org/tiny", {COMMIT_A: tiny_llama}, {"main": COMMIT_A}, blobs=False)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompt = [[5, 6, 7, 8, 9]]
    hub = LLM(model="org/tiny", dtype="float32", progress=False, kv_cache_memory_gb=0.01)
    local = LLM(model=str(tiny_llama), dtype="float32", progress=False, kv_cache_memory_gb=0.01)
    assert hub.generate(prompt_token_ids=prompt, sampling_params=params)[0].token_ids == \
        local.generate(prompt_token_ids=prompt, sampling_params=params)[0].token_ids
    assert served_model_name("org/tiny@main") == "org/tiny"          # vLLM serves the repository id


def test_gguf_only_repository_is_converted(tiny_models, offline, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from tandem.models.gguf_convert import ensure_float_weights
    from test_gguf import write_gguf

    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "tandem"))        # where conversions go

    src = tmp_path / "gguf-repo"
    src.mkdir()
    write_gguf(tiny_models["llama"], src / "tiny.Q8.gguf", "llama")
    hf_cache(offline, "org/tiny-GGUF", {COMMIT_A: src}, {"main": COMMIT_A})
    out = resolve_model("org/tiny-GGUF", progress=False)                # the repository's one .gguf
    assert out.parent == Path(os.environ["TANDEM_CACHE"]) / "models" and (out / "config.json").is_file()
    assert resolve_model("org/tiny-GGUF/tiny.Q8.gguf", progress=False) == out   # named; converted once
    assert not (out / "model.safetensors").exists()                   # the GGUF path reads the file in place
    ensure_float_weights(out, progress=False)                           # what a float load does first
    want = load_file(str(tiny_models["llama"] / "model.safetensors"))
    got = load_file(str(out / "model.safetensors"))
    assert all((got[k] == want[k]).all() for k in got)
    shutil.copy(src / "tiny.Q8.gguf", src / "tiny.F32.gguf")
    hf_cache(offline, "org/two-GGUF", {COMMIT_A: src}, {"main": COMMIT_A})
    with pytest.raises(ModelLoadError, match="2 GGUF files .*--model org/two-GGUF/tiny.F32.gguf"):
        resolve_model("org/two-GGUF", progress=False)


def test_cli_model_fetch_prints_the_snapshot(default_model_dir, offline, capsys):
    from tandem.cli import main

    root = hf_cache(offline, REPO, {COMMIT_A: default_model_dir}, {"main": COMMIT_A})
    assert main(["model", "fetch", "--model", REPO]) == 0
    assert capsys.readouterr().out.strip() == str(root / "snapshots" / COMMIT_A)
    assert main(["model", "fetch", "--model", "nobody/nothing"]) == 2
    assert "HF_HUB_OFFLINE=1" in capsys.readouterr().err
