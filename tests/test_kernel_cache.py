"""The CPU kernels' build cache: a build lock left by a killed build is cleared (it would hang every
later start), a fresh one is respected (another process is building)."""

from __future__ import annotations

import os
import time

from tandem.runner import kernels


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()
    kernels._clear_stale_lock(lock)
    assert lock.exists()                                   # a build may be running
    old = time.time() - kernels.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    kernels._clear_stale_lock(lock)
    assert not lock.exists()
    kernels._clear_stale_lock(lock)                        # no lock: nothing to do
