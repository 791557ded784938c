"""tandem.router: each policy's choice on hand-built replica stats."""

from __future__ import annotations

import pytest

from tandem.kv.hashing import hash_full_blocks
from tandem.router import ReplicaStats, RouteRequest, Router, digest_of, hash_ints, matched_blocks


def stats(rid, waiting=0, running=0, kv=0.1, paused=0, digest=frozenset(), waiting_requests=0, max_num_seqs=64):
    return ReplicaStats(rid, waiting, running, kv, paused, 0.0, digest, max_num_seqs, waiting_requests)


def hashes(first_token, num_blocks, block_size=16):
    return hash_ints(hash_full_blocks([first_token] + [11] * (num_blocks * block_size - 1), block_size))


def test_hash_helpers_match_kv_hashing():
    raw = hash_full_blocks(list(range(64)), 16)
    ints = hash_ints(raw)
    assert len(ints) == 4 and all(0 <= h < 2 ** 64 for h in ints)
    assert ints[0] == int.from_bytes(raw[0][:8], "big")
    assert digest_of(raw) == frozenset(ints)
    assert len(digest_of(raw, max_size=2)) == 2
    assert matched_blocks(ints, digest_of(raw[:3])) == 3
    assert matched_blocks(ints, digest_of(raw[1:])) == 0       # leading blocks only


def test_affinity_wins_when_not_overloaded():
    r = Router("tandem", seed=0)
    req = RouteRequest("s", hashes(1, 8), 128, tool_followup=True)
    r.observe(req, "b")
    reps = [stats("a"), stats("b", waiting=2000, running=30, kv=0.5), stats("c")]
    assert all(r.choose(req, reps) == "b" for _ in range(20))


def test_affinity_loses_when_overloaded():
    r = Router("tandem", seed=0)
    req = RouteRequest("s", hashes(1, 8), 128, tool_followup=True)
    r.observe(req, "b")
    reps = [stats("a"), stats("b", waiting=40000, running=64, kv=0.99), stats("c")]
    assert all(r.choose(req, reps) in ("a", "c") for _ in range(20))


def test_prefix_longest_wins():
    h = hashes(5, 10)
    reps = [stats("a", digest=frozenset(h[:2])), stats("b", digest=frozenset(h[:7])), stats("c", digest=frozenset(h[3:]))]
    req = RouteRequest(None, h, 160)
    assert Router("prefix", seed=0).choose(req, reps) == "b"
    assert Router("tandem", seed=0).choose(req, reps) == "b"


def test_prefix_without_match_is_random_but_seeded():
    reps = [stats(f"r{i}") for i in range(8)]
    req = RouteRequest(None, hashes(9, 4), 64)
    picks = [Router("prefix", seed=3).choose(req, reps) for _ in range(3)]
    assert len(set(picks)) == 1
    r = Router("prefix", seed=3)
    assert len({r.choose(req, reps) for _ in range(50)}) > 1


def test_power_of_two_picks_the_lighter_of_two():
    req = RouteRequest(None, (), 10)
    reps = [stats("light", running=1), stats("heavy", running=50, waiting_requests=10)]
    assert all(Router("power_of_two", seed=s).choose(req, reps) == "light" for s in range(20))
    # With many replicas it never picks the heaviest one (it loses every pair).
    many = [stats(f"r{i}", running=i) for i in range(8)]
    r = Router("power_of_two", seed=0)
    assert "r7" not in {r.choose(req, many) for _ in range(200)}


def test_tandem_without_affinity_is_power_of_two_on_load():
    req = RouteRequest("new", hashes(2, 4), 64)
    reps = [stats("light"), stats("heavy", waiting=30000, running=60, kv=0.9)]
    assert all(Router("tandem", seed=s).choose(req, reps) == "light" for s in range(20))


def test_round_robin_cycles():
    r = Router("round_robin")
    reps = [stats("a"), stats("b"), stats("c")]
    req = RouteRequest(None, (), 1)
    assert [r.choose(req, reps) for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]


@pytest.mark.parametrize("policy", ["tandem", "power_of_two", "prefix", "round_robin"])
def test_deterministic_per_seed(policy):
    reps = [stats(f"r{i}", running=i % 3, waiting=100 * (i % 4)) for i in range(6)]
    reqs = [RouteRequest(f"s{i % 5}", hashes(i % 5, 3), 48, i % 2 == 0) for i in range(40)]

    def trace(seed):
        r = Router(policy, seed=seed)
        out = []
        for q in reqs:
            c = r.choose(q, reps)
            r.observe(q, c)
            out.append(c)
        return out
    assert trace(7) == trace(7)
    if policy in ("power_of_two", "prefix"):
        assert trace(7) != trace(8)


def test_session_lru_is_bounded_by_count():
    r = Router("tandem", session_capacity=3)
    for i in range(5):
        r.observe(RouteRequest(f"s{i}", (), 1), "a")
    assert r.num_sessions == 3
    assert r.session_replica("s0") is None and r.session_replica("s4") == "a"
    r.observe(RouteRequest("s2", (), 1), "b")          # refreshes s2: s3 is now the oldest
    r.observe(RouteRequest("s5", (), 1), "a")
    assert r.session_replica("s3") is None and r.session_replica("s2") == "b"
    r.observe(RouteRequest(None, (), 1), "a")           # no session: nothing recorded
    assert r.num_sessions == 3


def test_forget_replica():
    r = Router("tandem")
    r.observe(RouteRequest("s1", (), 1), "a")
    r.observe(RouteRequest("s2", (), 1), "b")
    r.forget_replica("a")
    assert r.session_replica("s1") is None and r.session_replica("s2") == "b"
    req = RouteRequest("s1", hashes(1, 2), 32, tool_followup=True)
    assert Router("tandem").choose(req, [stats("b")]) == "b"


def test_bad_arguments():
    with pytest.raises(ValueError):
        Router("nope")
    with pytest.raises(ValueError):
        Router("tandem", weights={"bogus": 1.0})
    with pytest.raises(ValueError):
        Router("tandem").choose(RouteRequest(None, (), 1), [])
