"""Overlap of drafting and verification (FASER): frontier f+1 is drafted while frontier f is verified.

With `SpecConfig(overlap=True, frontier_size=F)` a model drafter first drafts only a request's first
frontier (F tokens). While the target verifies frontier f, a `DraftWorker` drafts frontier f+1 on
separate compute; a rejection in frontier f cancels the drafting in flight (the worker drops the
request from its remaining draft passes) and the frontiers after it are never drafted. The loop
that drives it is tandem.speculative.verify_round; output stays exactly the target's, since only drafts
are computed concurrently and every emitted token comes from verification.

Separate compute:
- CPU: the worker is one thread with `draft_threads` intra-op threads; while it runs, the verifying
  thread gives up as many of its own, so the two never oversubscribe the cores. Once verification
  is done and waits for the drafts, the worker takes every thread for its remaining draft passes,
  so no core idles. (torch.set_num_threads acts per thread for OpenMP, which both oneDNN and ATen's
  parallel loops use here.)
- CUDA: the worker drafts on its own stream, ordered after everything already queued on the main
  stream (the KV the drafts attend to); the main stream waits for the draft stream before it uses
  the drafts.

Layer-skip drafting writes its layers' KV into the target's cache at the next frontier's positions
while verification writes the current frontier's (disjoint slots). The drafter also reads the
current frontier's slots, which verification rewrites with the same values up to float rounding:
that can only change a draft, never an emitted token.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import torch

from tandem.errors import ConfigError


class DraftWorker:
    def __init__(self, device: torch.device, draft_threads: int = 1) -> None:
        self.device = device
        self.draft_threads = draft_threads
        self.total_threads = torch.get_num_threads()     # of the thread that runs the engine
        if device.type == "cpu" and self.total_threads <= draft_threads:
            raise ConfigError(f"overlap needs more CPU threads than draft_threads ({draft_threads}) to leave "
                              f"some for verification; this engine has {self.total_threads}")
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # The initializer must not reference self: the pool's thread would keep the worker alive
        # forever (it exits once the pool is garbage-collected).
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-draft",
                                        initializer=torch.set_num_threads if device.type == "cpu" else None,
                                        initargs=(draft_threads,) if device.type == "cpu" else ())
        self._verifier_waiting = threading.Event()
        self._worker_threads = draft_threads
        self.num_overlapped = 0         # passes verified while a frontier was drafted

    def pace(self) -> None:
        """Called by the drafter before each pass, on the worker: all threads once the verifier waits."""
        if self.device.type != "cpu":
            return
        want = self.total_threads if self._verifier_waiting.is_set() else self.draft_threads
        if want != self._worker_threads:
            torch.set_num_threads(want)
            self._worker_threads = want

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run fn(*args) on the worker (on CUDA: on the draft stream, after the main stream's queued work)."""
        self._verifier_waiting.clear()
        if self._stream is None:
            return self._pool.submit(fn, *args)
        ready = torch.cuda.current_stream(self.device).record_event()
        stream = self._stream

        def on_stream():
            with torch.cuda.stream(stream):
                stream.wait_event(ready)
                out = fn(*args)
                return out, stream.record_event()
        return self._pool.submit(on_stream)

    def result(self, future: Future) -> Any:
        """Wait for the worker; later work on the main stream is ordered after the drafts."""
        self._verifier_waiting.set()
        if self._stream is None:
            return future.result()
        out, done = future.result()
        torch.cuda.current_stream(self.device).wait_event(done)
        return out

    @contextmanager
    def verifying(self):
        """The verifier's side of an overlapped pass: fewer intra-op threads while the worker drafts."""
        self.num_overlapped += 1
        if self.device.type != "cpu":
            yield
            return
        torch.set_num_threads(self.total_threads - self.draft_threads)
        try:
            yield
        finally:
            torch.set_num_threads(self.total_threads)
