"""`kvedit bench soak`: what its clients' results add up to (mixed.py runs them).

Every worker and laggard counts its operations, the chunks it checked byte for byte, torn
reads and errors; every attacker counts what it was answered. Here they are summed, and an
error is *unexpected* unless the role may get it (EXPECTED in common.py for clients,
ATTACK_OK for attackers, each of which must also meet its ATTACK_MUST at least once) or it
came during a server restart (a restart, and calls sent up to CLIENT_TIMEOUT_S before it).
"""
from __future__ import annotations

RESTART_GRACE_S = 3.0   # errors this long after a restart belong to the restart
CLIENT_TIMEOUT_S = 5.0  # ... and those of calls sent up to this long before it


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3)


def thin(points: list, n: int) -> list:
    """At most about n of `points`, evenly spaced, the last one kept."""
    if len(points) <= n:
        return points
    step = len(points) / n
    return [points[int(i * step)] for i in range(n)] + [points[-1]]

ATTACKERS = ("leaseflood", "poolpin", "httpflood", "watchflood", "handshakes", "watcher",
             "relay", "unregister", "nonreading", "fewsessions")
# what the attackers may be answered; each must also meet its `must` at least once
ATTACK_OK = {
    "leaseflood": {"Leased", "over_quota", "unknown_model", "no_reply"},
    "poolpin": {"StoreSlots", "over_quota", "pool_full", "unknown_model", "no_reply",
                "commit:Committed", "commit:store_expired", "commit:unknown_store",
                "commit:no_reply", "release:Ok", "release:lease_expired",
                "release:unknown_lease", "release:no_reply", "retrieve:Leased",
                "retrieve:over_quota", "retrieve:unknown_model", "retrieve:no_reply"},
    "httpflood": {"health:200", "half_closed_status:200"},
    "l2poison": {"planted"},
    "watchflood": {"subscribed", "send_blocked"},
    "handshakes": {"opened", "closed_by_server", "refused"},
    # "miss_wrong" (the copy said "not there" for a key the server held) is never allowed
    "watcher": {"untrusted", "says_there", "miss_right", "miss_caught_up", "catch_up_slow",
                "miss_evicted_since"},
    # "proven_through_relay" and "leaked" are never allowed
    "relay": {"refused", "relay_down"},
    "unregister": {"unregistered", "busy", "no_reply", "register:busy", "register:no_reply",
                   "store:pool_full", "store:over_quota", "store:no_reply",
                   "store:unknown_model", "unknown_model"},  # a restart forgets its model
    "nonreading": {"sent", "send_blocked"},
    "fewsessions": {"Leased", "over_quota", "unknown_model", "no_reply"},
}
ATTACK_MUST = {"leaseflood": "over_quota", "poolpin": "over_quota", "httpflood": "health:200",
               "l2poison": "planted", "watchflood": "subscribed", "handshakes": "opened",
               "watcher": "miss_right", "relay": "refused", "unregister": "unregistered",
               "nonreading": "sent", "fewsessions": "over_quota"}



def summarize(results: dict, restarts: list[tuple[float, float]]) -> dict:
    def in_restart(t: float) -> bool:
        return any(a - CLIENT_TIMEOUT_S - 0.5 <= t <= b + RESTART_GRACE_S for a, b in restarts)

    ops, torn, stale, checked = 0, 0, 0, 0
    errors: dict[str, int] = {}
    unexpected, examples, during_restart = 0, [], 0
    for role in ("worker", "laggard"):
        for r in results.get(role, []):
            ops += r["ops"]
            torn += r["torn_reads"]
            stale += r["stale_detected"]
            checked += r["chunks_checked"]
            for code, n in r["errors"].items():
                errors[code] = errors.get(code, 0) + n
            restart_odd = sum(in_restart(t) for t, _, _ in r["odd"])
            during_restart += restart_odd
            unexpected += r["odd_count"] - restart_odd
            examples += [o for o in r["odd"] if not in_restart(o[0])][:5]
    late: dict = {}
    for r in results.get("laggard", []):
        for k, v in r["notes"].items():
            late[k] = late.get(k, 0) + v if isinstance(v, int) else v
    # the fence: a late commit must be refused; every stalled transfer must be cut
    unexpected += late.get("late_commits_accepted", 0)
    stalls = results.get("stall", [])
    for s in stalls:
        ok = s.get("server_closed_it") and s.get("late_reply") in (
            "store_expired", "lease_expired", "unknown_store", "unknown_lease")
        if not ok and not s.get("setup_failed"):
            unexpected += 1
            examples.append(["stall", s])
    overs = results.get("oversized", [])
    for over in overs:
        if over.get("too_many_keys") != "too_many_keys" or over.get("hello_after") != \
                "ServerInfo" or over.get("tiny_keys") != "too_many_keys":
            unexpected += 1
            examples.append(["oversized", over])
    attacks = {}
    for role, allowed in ATTACK_OK.items():
        for r in results.get(role, []):
            odd = {k: n for k, n in r["counts"].items() if k not in allowed
                   and not all(in_restart(t) for t in r["when"].get(k, [0.0]))}
            missed = r["counts"].get(ATTACK_MUST[role], 0) == 0
            unexpected += sum(odd.values()) + missed
            if odd or missed:
                examples.append([role, {"odd": odd, "missing": ATTACK_MUST[role] if missed
                                        else None,
                                        "when": {k: r["when"].get(k, [])[:5] for k in odd},
                                        "restarts": [[round(a, 3), round(b, 3)]
                                                     for a, b in restarts]}])
            attacks[role] = r["counts"]
    for bad in ("crashed", "overran"):
        unexpected += len(results.get(bad, []))
        examples += [[bad, x] for x in results.get(bad, [])][:3]
    hello = [ms for r in results.get("pinger", []) for t, ms in r["samples"] if not in_restart(t)]
    fails = [t for r in results.get("pinger", []) for t in r["failures"] if not in_restart(t)]
    unexpected += len(fails)
    if fails:
        examples.append(["hello without a reply within 1 s, sent at", fails[:5]])
    per_worker = [{"transport": r["notes"].get("transport"), "ops": r["ops"],
                   "by_kind": r["by_kind"], "errors": r["errors"],
                   "chunks_checked": r["chunks_checked"],
                   "idle_periods": r["notes"].get("idle_periods", 0),
                   "client_counters": r["notes"].get("client_counters")}
                  for r in results.get("worker", [])]
    return {"ops": ops, "chunks_checked": checked, "per_worker": per_worker,
            "errors_by_code": errors,
            "unexpected_errors": unexpected, "unexpected_examples": examples[:10],
            "errors_during_restart": during_restart, "torn_reads": torn,
            "stale_reads_refused_by_fence": stale, "late_writer_reader": late,
            "stalls": stalls[:6], "oversized": overs[:3], "attacks": attacks,
            "hello_count": len(hello), "hello_failures": len(fails),
            "hello_p50_ms": pct(hello, 0.5), "hello_p99_ms": pct(hello, 0.99),
            "hello_max_ms": pct(hello, 1.0)}
