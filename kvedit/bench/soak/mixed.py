"""`kvedit bench soak`'s mixed phase: one server on its made secret (and its L2 Redis), the
client and attacker processes, the timeline of kills, stalls, restarts and idle periods, the
RSS and queue sampler, then the leak check (the package docstring says what each does).

Why a module of its own: it owns every child process it starts (`Procs`: all of them are
stopped whatever happens) and the one server instance whose leaks and memory are measured.
"""
from __future__ import annotations

import json
import random
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from kvedit import auth
from kvedit.bench.soak import attacks
from kvedit.bench.soak import procs as clients
from kvedit.bench.soak.common import LAYOUT
from kvedit.bench.soak.restart import env_with_rundir, made_secret_server
from kvedit.bench.soak.scale import rss_mb
from kvedit.bench.soak.summary import ATTACKERS, CLIENT_TIMEOUT_S, pct, summarize, thin
from kvedit.launch.redis import RedisProcess, redis_server_path
from kvedit.server.config import ServerConfig

CYCLE_S = 600.0         # a long run repeats the timeline of events every this many seconds
DATA_IDLE_S = 10.0      # the soak server's --data-idle-timeout (idle periods outlast it),
                        # at most a twentieth of a cycle (short runs keep working)
RSS_EVERY_S = 2.0
POOL_SHARE = ServerConfig(l1_size_gb=1).max_client_pool_fraction   # the soak keeps the default


class Procs:
    """Every child process started, so that all of them are stopped whatever happens.

    A child imports, prints one "ready" line, then waits for its "go" line (common.py)."""

    def __init__(self, logdir: Path, base: dict, env: dict | None = None):
        self.logdir, self.base, self.env = logdir, base, env
        self.running: list[tuple[str, subprocess.Popen]] = []
        self.results: dict[str, list[dict]] = {}
        self.logs: dict[int, Path] = {}   # pid -> its stderr
        self.n = 0

    def spawn(self, role: str, **cfg) -> subprocess.Popen:
        self.n += 1
        path = self.logdir / f"{role}-{self.n}.log"
        with open(path, "wb") as err:
            p = subprocess.Popen([sys.executable, "-m", _module(role), role,
                                  json.dumps(self.base | cfg)], stdout=subprocess.PIPE,
                                 stderr=err, stdin=subprocess.PIPE, env=self.env)
        self.logs[p.pid] = path
        self.running.append((role, p))
        return p

    @staticmethod
    def line(p: subprocess.Popen, timeout: float) -> dict | None:
        """The child's next stdout line as JSON, or None after `timeout` s or at its end."""
        ready, _, _ = select.select([p.stdout], [], [], timeout)
        raw = p.stdout.readline() if ready else b""
        return json.loads(raw) if raw.strip() else None

    @staticmethod
    def go(p: subprocess.Popen, **cfg) -> None:
        p.stdin.write((json.dumps(cfg) + "\n").encode())
        p.stdin.flush()

    def forget(self, p: subprocess.Popen) -> None:
        self.running = [(r, q) for r, q in self.running if q is not p]

    def collect(self, timeout: float) -> None:
        """Wait for each child (until `timeout` s from now), then SIGKILL the rest."""
        end = time.monotonic() + timeout
        for role, p in self.running:
            try:
                out, _ = p.communicate(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.communicate()
                self.results.setdefault("overran", []).append({"role": role})
                continue
            lines = out.decode(errors="replace").strip().splitlines()
            if p.returncode == 0 and lines:
                self.results.setdefault(role, []).append(json.loads(lines[-1]))
            elif p.returncode != -signal.SIGKILL:
                self.results.setdefault("crashed", []).append(
                    {"role": role, "rc": p.returncode, "log": self.log(p)})
        self.running = []

    def log(self, p: subprocess.Popen) -> str:
        """The end of the child's stderr."""
        return self.logs[p.pid].read_text(errors="replace")[-500:]

    def kill_one(self, p: subprocess.Popen) -> None:
        p.kill()
        p.wait()
        self.forget(p)

    def kill_all(self) -> None:
        for _, p in self.running:
            if p.poll() is None:
                p.kill()
            p.wait()
        self.running = []


def _module(role: str) -> str:
    """The module whose `main` runs a child role: the attackers start without torch."""
    return attacks.__name__ if role in attacks.ROLES else clients.__name__


def _victim(procs: Procs, p: subprocess.Popen, rng: random.Random, shm: bool, what: str,
            deadline: float) -> str:
    """Let a ready victim take a lease or prepare a store, and SIGKILL it while it holds."""
    procs.go(p, shm=shm, what=what, seed=rng.randrange(1 << 30), deadline=deadline)
    held = procs.line(p, 10.0)
    time.sleep(rng.random() * 0.2)
    p.kill()
    p.wait()
    procs.forget(p)
    return "killed holding" if held else "killed before it held"


# One cycle of the mixed phase, as fractions of the cycle; a run has max(1, run / CYCLE_S)
# cycles. The server restarts early in the first cycle (and half-way through a run of
# several), so the hostile events after it are on the server instance whose leaks and memory
# are measured; Redis restarts in every cycle.
EVENTS = sorted([(0.30, "stall get"), (0.35, "oversized"), (0.45, "stall put"),
                 (0.60, "redis restart")] + [(0.05 + 0.9 * k / 12, "victim") for k in range(12)])
IDLE_AT = (0.40, 0.75)   # workers pause for the data idle timeout + 1 s here, each cycle
VICTIM_KINDS = [(True, "store"), (False, "store"), (True, "lease"), (False, "lease"),
                (True, "storing"), (False, "storing")]   # (shared memory?, what it holds)


class MixedRun:
    """The mixed phase: one server (and its L2 Redis), client processes, the timeline, the
    RSS sampler, then the leak check."""

    def __init__(self, args, rundir: Path, logdir: Path):
        self.args, self.ttl = args, args.ttl
        self.run_s = args.hours * 3600 if args.hours is not None else args.minutes * 60
        self.cycles = max(1, round(self.run_s / CYCLE_S))
        self.data_idle = round(min(DATA_IDLE_S, self.run_s / self.cycles / 20), 2)
        self.rng = random.Random(args.seed)
        self.pool_chunks = (args.pool_mb << 20) // LAYOUT.chunk_bytes
        # a stalled GET outgrows the kernel's buffers (tcp_wmem up to 4 MiB) but stays within
        # what one session may pin of the pool (else its store is refused, over_quota)
        self.stall_chunks = min(192, int(self.pool_chunks * POOL_SHARE))
        self.chunk_bytes = LAYOUT.chunk_bytes
        self.redis = None
        if not args.no_l2 and redis_server_path() is not None:
            self.redis = RedisProcess()
        t = str(args.ttl)
        l2 = ["--l2-url", self.redis.url, "--l2-mac"] if self.redis is not None else []
        # every process of the run finds the server's own secret in this runtime directory
        self.env = env_with_rundir(rundir)
        try:
            self.srv = made_secret_server(args.pool_mb / 1024, self.env, [
                "--lease-ttl", t, "--write-ttl", t, "--quarantine-ttl", str(2 * args.ttl),
                "--transfer-idle-timeout", "2", "--transfer-timeout", "20",
                "--data-idle-timeout", str(self.data_idle),
                # the attackers meet their caps within seconds (8 sessions together the
                # leases' total); the stalled GET (12 MiB, more than the kernel buffers) still
                # fits beside the pool pinner's quarter, the workers and the victims: the
                # reserve's line at 7/8
                "--max-leases-per-client", "32", "--max-leases-total", "256",
                "--quota-reserve", "0.125", *l2])
        except BaseException:
            if self.redis is not None:
                self.redis.stop()
            raise
        self.secret_file = str(rundir / "kvedit" / f"{self.srv.port}.secret")
        self.base = {"url": self.srv.url, "keys": args.keys, "ttl": args.ttl,
                     "timeout": CLIENT_TIMEOUT_S, "data_port": self.srv.data_port}
        self.procs = Procs(logdir, self.base, self.env)
        self.queues: list[list[float]] = []   # [t, L2 write-behind MiB, key-watch MiB]
        self.server_stops_s: list[float] = []   # how long each restart's stop took
        self.victims: list[str] = []
        self.restarts: list[tuple[float, float]] = []   # server and Redis
        self.rss_base: tuple[float, float] | None = None
        self.rss: list[list[float]] = []
        self._sampling = threading.Event()

    def run(self) -> dict:
        sampler = threading.Thread(target=self._sample_rss, daemon=True)
        try:
            self._start_clients()
            sampler.start()
            for c in range(self.cycles):
                self._timeline(c)
            time.sleep(max(0.0, self.deadline - time.time()))
            self.procs.collect(timeout=2 * self.ttl + 30)
            checked = self._check()
            self._sampling.set()
            return checked | summarize(self.procs.results, self.restarts) | {
                "cycles": self.cycles, "l2": self.redis is not None,
                "victims": self.victims[:24], "victim_count": len(self.victims),
                "restarts": [{"began_s": round(a - self.t0, 3), "seconds": round(b - a, 3)}
                             for a, b in self.restarts],
                "server_stops_s": self.server_stops_s,
                "rss_samples_mb": thin(self.rss, 300),
                "started_at": round(self.t0, 3)}
        finally:
            self._sampling.set()
            self.procs.kill_all()
            self.server_exit_code = self.srv.stop()
            if self.redis is not None:
                self.redis.stop()

    def _sample_rss(self) -> None:
        while not self._sampling.wait(RSS_EVERY_S):
            t = round(time.time() - self.t0, 1)
            try:
                self.rss.append([t, round(rss_mb(self.srv.pid), 1)])
                headers = auth.bearer_header(auth.load_secret(None, self.secret_file))
                c = httpx.get(self.srv.http_url + "/status", headers=headers,
                              timeout=5).json()["counters"]
                self.queues.append([t, round(c.get("l2_queue_bytes", 0) / 2**20, 2),
                                    round(c["key_watch_queued_bytes"] / 2**20, 2)])
            except (AttributeError, OSError, KeyError, ValueError, httpx.HTTPError):
                pass   # restarting

    def _start_clients(self) -> None:
        procs, rng, run_s = self.procs, self.rng, self.run_s
        self.steady = [procs.spawn("pinger", max_ops=int(run_s * 150) + 100)]
        for i in range(self.args.shm_clients + self.args.socket_clients):
            self.steady.append(procs.spawn("worker", shm=i < self.args.shm_clients,
                                           seed=rng.randrange(1 << 30),
                                           max_ops=int(run_s * 4000) + 100))
        self.steady.append(procs.spawn("laggard", shm=True, seed=rng.randrange(1 << 30),
                                       max_ops=int(run_s) + 1000))
        attackers = [procs.spawn(role, seed=rng.randrange(1 << 30)) for role in ATTACKERS]
        if self.redis is not None:
            attackers.append(procs.spawn("l2poison", seed=rng.randrange(1 << 30),
                                         l2_url=self.redis.url))
        # victims start importing early (seconds on a busy box): (process, said "ready")
        self.spares = [(procs.spawn("victim"), False), (procs.spawn("victim"), False)]
        first = self.spares[0][0]
        for p in [*self.steady, *attackers, first]:   # imports done: start the clock
            if procs.line(p, 180.0) is None:
                raise RuntimeError(f"a soak client did not start: {procs.log(p)}")
        self.spares[0] = (first, True)
        self.t0 = time.time()
        self.deadline = self.t0 + run_s
        cycle = run_s / self.cycles
        idle = [[self.t0 + (c + f) * cycle, self.t0 + (c + f) * cycle + self.data_idle + 1]
                for c in range(self.cycles) for f in IDLE_AT]
        for p in self.steady:
            procs.go(p, deadline=self.deadline, idle_windows=idle)
        for p in attackers:
            procs.go(p, deadline=self.deadline, http=[self.srv.host, self.srv.http_port],
                     keys=self.args.keys)

    def _timeline(self, c: int) -> None:
        cycle = self.run_s / self.cycles
        events = list(EVENTS)
        if c == 0 or (self.cycles > 2 and c == self.cycles // 2):
            events = sorted(events + [(0.15, "restart")])
        for frac, what in events:
            time.sleep(max(0.0, self.t0 + (c + frac) * cycle - time.time()))
            if what == "victim":
                self._victim()
            elif what.startswith("stall"):
                self._one_shot("stall", what=what.split()[1], stall_seconds=8.0,
                               data_port=self.srv.data_port,
                               seed=self.rng.randrange(1 << 30),
                               stall_chunks=self.stall_chunks)
            elif what == "oversized":
                self._one_shot("oversized")
            elif what == "redis restart" and self.redis is not None:
                r0 = time.time()
                self.redis.kill()
                time.sleep(1.0)
                self.redis.start()
                self.restarts.append((r0, time.time()))
            elif what == "restart":
                r0 = time.time()
                self.srv.stop()
                self.server_stops_s.append(round(time.time() - r0, 2))
                self.srv.restart()   # the same ports and flags; the made secret is reused
                self.restarts.append((r0, time.time()))
                time.sleep(min(5.0, cycle * 0.05))
                self.rss_base = (rss_mb(self.srv.pid), rss_mb(self.srv.pid, "RssAnon"),
                                 rss_mb(self.srv.pid, "VmRSS"))
        if c == self.cycles - 1:
            for p, _ in self.spares:
                self.procs.kill_one(p)

    def _one_shot(self, role: str, **cfg) -> None:
        """A client for one event: started now (raw-protocol roles import in a second)."""
        p = self.procs.spawn(role)
        if self.procs.line(p, 60.0) is None:
            self.procs.results.setdefault("crashed", []).append(
                {"role": role, "rc": None, "log": "did not start in 60 s"})
            self.procs.kill_one(p)
            return
        self.procs.go(p, deadline=self.deadline, **cfg)

    def _victim(self) -> None:
        p, ready = self.spares.pop(0)
        if not ready and self.procs.line(p, 60.0) is None:
            self.victims.append("a victim did not start in 60 s")
            self.procs.kill_one(p)
        else:
            shm, kind = VICTIM_KINDS[len(self.victims) % len(VICTIM_KINDS)]
            self.victims.append(f"{'shm' if shm else 'socket'} {kind}: "
                                + _victim(self.procs, p, self.rng, shm, kind, self.deadline))
        self.spares.append((self.procs.spawn("victim"), False))

    def _check(self) -> dict:
        """Every client is gone: wait out the TTLs and the quarantine, then read /status."""
        headers = auth.bearer_header(auth.load_secret(None, self.secret_file))
        with httpx.Client(base_url=self.srv.http_url, headers=headers, timeout=30) as http:
            settle_end = time.monotonic() + 4 * self.ttl + 10
            while time.monotonic() < settle_end:
                st = http.get("/status").json()
                if st["leases"] == 0 and st["pending_stores"] == 0 and not _quarantined(st):
                    break
                time.sleep(0.5)
            st = http.get("/status").json()
            l2_after = st.get("l2")
            http.delete("/cache").raise_for_status()
            after = http.get("/status").json()
            drain_end = time.monotonic() + 60   # growth is measured once L2 has caught up
            while after.get("l2") and after["l2"]["queue"]["depth"] and \
                    time.monotonic() < drain_end:
                time.sleep(0.5)
                after = http.get("/status").json()
            queue_at_end = (after.get("l2") or {}).get("queue", {}).get("bytes", 0)
            time.sleep(2 * RSS_EVERY_S)   # a trim after the burst (trim.py) has had its turn
            rss_end = (rss_mb(self.srv.pid), rss_mb(self.srv.pid, "RssAnon"),
                       rss_mb(self.srv.pid, "VmRSS"))
            rss_base = self.rss_base or rss_end
            keepalive = []
            for _ in range(200):   # sequential GET /health over one keep-alive connection
                s0 = time.perf_counter()
                http.get("/health").raise_for_status()
                keepalive.append((time.perf_counter() - s0) * 1e3)
        return {
            "leaked_leases": st["leases"],
            # after DELETE /cache nothing may hold a slot; a store still writing would
            "leaked_slots": after["pool"]["used"] // self.chunk_bytes + st["objects"]["writing"],
            "status_after_clients": {k: st[k] for k in ("leases", "pending_stores", "objects",
                                                        "evictions", "counters")},
            "pool_used_after_delete": after["pool"]["used"],
            "rss_mb_after_restart": round(rss_base[0], 1), "rss_mb_end": round(rss_end[0], 1),
            "rss_growth_mb": round(rss_end[0] - rss_base[0], 1),     # VmRSS - RssShmem
            "anon_rss_growth_mb": round(rss_end[1] - rss_base[1], 1),
            "vmrss_growth_mb": round(rss_end[2] - rss_base[2], 1),   # with pool pages
            "http_keepalive_p50_ms": pct(keepalive, 0.5),
            "http_keepalive_p99_ms": pct(keepalive, 0.99),
            "l2_status": l2_after,
            # what the growth was measured beside, and what the queues reached meanwhile
            "l2_queue_bytes_at_rss_end": queue_at_end,
            "l2_queue_peak_mb": max((q[1] for q in self.queues), default=None),
            "key_watch_queue_peak_mb": max((q[2] for q in self.queues), default=None),
            "queue_samples_mb": thin(self.queues, 150),
            "key_watch_counters": {k: after["counters"].get(k) for k in (
                "key_watch_drops", "key_watch_cuts", "key_snapshot_parts", "key_pushes",
                "key_watch_reclaimed")},
            # sockets cut for not reading their replies, ZMQ connections shut over the bound
            "bound_counters": {k: after["counters"].get(k) for k in (
                "reply_cuts", "reply_queued_bytes", "zmq_conns_refused")},
        }


def mixed_phase(args, rundir: Path, logdir: Path) -> dict:
    run = MixedRun(args, rundir, logdir)
    out = run.run()
    return out | {"server_exit_code": run.server_exit_code}


def _quarantined(st: dict) -> bool:
    return any(v for k, v in st.get("counters", {}).items() if k.startswith("quarantine"))
