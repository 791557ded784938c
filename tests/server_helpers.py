"""Test helpers for the HTTP server: a real uvicorn server on a free port in a background thread,
and a tiny engine to put behind it."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import uvicorn

from tandem import LLM
from tandem.engine.async_engine import AsyncLLMEngine
from tandem.server.launch import http_protocol


class LiveServer:
    """uvicorn serving `app` on 127.0.0.1 (a free port) until `stop()`."""

    def __init__(self, app: Any) -> None:
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on",
                                timeout_graceful_shutdown=2, http=http_protocol())   # tandem serve's own
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="test-uvicorn", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def long_context_copy(model_dir: Path, out: Path, max_positions: int = 2048) -> Path:
    """The tiny model with a longer context (random RoPE weights work at any length): prompts with
    tool schemas take ~700 tokens of the test tokenizer's tiny vocabulary."""
    shutil.copytree(model_dir, out, dirs_exist_ok=True)
    cfg = json.loads((out / "config.json").read_text())
    cfg["max_position_embeddings"] = max_positions
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def tiny_engine(model_dir: Path, max_waiting: int = 64) -> AsyncLLMEngine:
    llm = LLM(model=str(model_dir), dtype="float32", progress=False, max_num_seqs=16)
    return AsyncLLMEngine(llm.engine, max_waiting=max_waiting)


def module_engine(name: str = "engine"):
    """A module-scoped fixture `name`: a tiny engine on the session's tiny Llama, shut down after
    the module (each module gets its own, so no test sees another module's traffic)."""
    @pytest.fixture(scope="module", name=name)
    def fixture(tiny_llama):
        eng = tiny_engine(tiny_llama)
        yield eng
        eng.shutdown()

    return fixture


def wait_until(cond: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def engine_idle(engine: AsyncLLMEngine) -> bool:
    """No request in flight and every KV block back in the pool."""
    sched = engine.engine.scheduler
    return (engine.num_pending == 0 and sched.num_running == 0 and sched.num_waiting == 0
            and sched.kv.num_free_blocks == sched.kv.num_blocks)
