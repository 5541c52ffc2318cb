"""The soak run's timeline and report (see the package docstring).

Timeline, by the share of planned turns that have ended: bad input to every route at the start
(both replicas up); at ``kill_at`` replica 1 is SIGKILLed (the leases the proxy holds on it then
are the turns that may have reached it), and ``down_sec`` later it is restarted at its address;
the proxy's RSS is read at the start, at half the turns and at the end. Once every session is
done and replica 1 serves again: bad input again (the restarted engine included), a completion
on each engine directly and new sessions through the proxy, then a wait of one idle grace and
the gates' leases and reservations are read from the proxy's ``/metrics``."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from dataclasses import dataclass, field

import httpx

from session_gate.lab.engine.tiny_tokenizer import word_ids
from session_gate.lab.soak.bad_input import send_bad_input
from session_gate.lab.soak.cluster import Cluster, Engines, get_text, metric, samples
from session_gate.lab.soak.sessions import Sessions, Workload


@dataclass
class SoakConfig:
    workload: Workload = field(default_factory=Workload)
    engines: Engines = field(default_factory=Engines)
    idle_grace_sec: float = 10.0
    kill_at: float = 0.3
    down_sec: float = 10.0
    max_body_bytes: int = 262_144
    gate_at: str = "proxy"
    release: bool = True
    traffic_timeout_sec: float = 900.0

    def proxy_args(self) -> list[str]:
        return ["--idle-grace-sec", str(self.idle_grace_sec), "--health-interval-sec", "1",
                "--wait-poll-sec", "0.5", "--max-wait-sec", "30", "--gate-at", self.gate_at,
                "--max-body-bytes", str(self.max_body_bytes)]  # fmt: skip


def _log(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", flush=True)


async def _until(predicate, timeout: float, poll: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(poll)
    return True


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


async def _engines_serving(cluster: Cluster) -> list[bool]:
    """Each replica alive, healthy and answering a completion of its own."""
    out = []
    async with httpx.AsyncClient(timeout=120) as http:
        for url, alive in zip(cluster.urls, cluster.alive(), strict=True):
            ok = alive and _healthy(url)
            if ok:
                body = {"model": "tiny", "prompt": word_ids(77, 16), "max_tokens": 2}
                r = await http.post(f"{url}/v1/completions", json=body)
                ok = r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
            out.append(ok)
    return out


async def _fresh_sessions(cluster: Cluster, n: int) -> dict[str, int]:
    """``n`` new sessions through the proxy after the restart: statuses, and how many turns
    each replica's vLLM counts (new sessions go to the emptier one: the restarted replica)."""
    before = [metric(get_text(f"{u}/metrics"), "vllm:request_success_total") for u in cluster.urls]
    statuses: dict[str, int] = {}
    async with httpx.AsyncClient(timeout=120) as http:

        async def one(k: int) -> None:
            await asyncio.sleep(0.1 * k)
            body = {"model": "tiny", "prompt": word_ids(5000 + 50 * k, 24), "max_tokens": 32}
            r = await http.post(f"{cluster.proxy_url}/sess/post-{k}/v1/completions", json=body)
            statuses[str(r.status_code)] = statuses.get(str(r.status_code), 0) + 1

        # Every session stays pinned (and holds its reservation) until all have been placed:
        # the emptier replica — the restarted one — takes its share. Finishing each as soon as
        # its turn ended let a fast engine serve them one at a time, each finding both replicas
        # empty and taking the first (on 4 Dec 2026 the restarted replica served none of them).
        await asyncio.gather(*(one(k) for k in range(n)))
        for k in range(n):
            await http.post(f"{cluster.proxy_url}/sess/post-{k}/finish")
    after = [metric(get_text(f"{u}/metrics"), "vllm:request_success_total") for u in cluster.urls]
    return {
        "statuses": statuses,
        "served_by_replica": [int(a - b) for a, b in zip(after, before, strict=True)],
    }


def _engine_stats(url: str) -> dict:
    """The engine gate's counters on one replica (``--gate-at engine`` gates there)."""
    import json

    try:
        stats = json.loads(get_text(f"{url}/session_gate/v1/stats", timeout=10))
    except OSError as e:
        return {"error": repr(e)}
    keys = ("leases_active", "reservations_held", "committed_blocks", "waiting")
    return {k: stats.get(k) for k in keys}


def _gate_state(cluster: Cluster, engine: bool) -> dict:
    """Leases and reservations held: the proxy's gates (``--gate-at proxy``) or the engines'."""
    text = get_text(f"{cluster.proxy_url}/metrics")
    per = {
        url: {
            "leases_active": int(metric(text, "session_gate_leases_active", replica=url)),
            "reservations_held": int(metric(text, "session_gate_reservations_held", replica=url)),
            "committed_blocks": int(metric(text, "session_gate_committed_blocks", replica=url)),
        }
        for url in cluster.urls
    }
    if engine:
        per = {url: _engine_stats(url) for url in cluster.urls}
    return {
        "leases_active": sum(p.get("leases_active") or 0 for p in per.values()),
        "reservations_held": sum(p.get("reservations_held") or 0 for p in per.values()),
        "per_replica": per,
        "proxy_requests": {
            k: int(v) for k, v in samples(text, "session_gate_proxy_requests_total").items()
        },
        "pinned_sessions": int(metric(text, "session_gate_proxy_sessions")),
    }


async def run(cfg: SoakConfig) -> dict:
    """The whole soak; returns the report (``ok`` says whether every target was met)."""
    started = time.monotonic()
    if cfg.gate_at == "engine":
        # The engine gate's knobs are the engines' environment.
        cfg.engines.env = {
            "SESSION_GATE_IDLE_GRACE_SEC": str(cfg.idle_grace_sec),
            "SESSION_GATE_WAIT_POLL_SEC": "0.5",
            "SESSION_GATE_MAX_WAIT_SEC": "30",
        }
    cluster = Cluster(cfg.engines, cfg.proxy_args(), release=cfg.release)
    loop = asyncio.get_running_loop()
    try:
        _log("starting two vllm serve replicas and the proxy")
        await loop.run_in_executor(None, cluster.start)
        _log(f"replicas {cluster.urls}, proxy {cluster.proxy_url}")
        rss = {"start": cluster.proxy_rss_kib()}
        sessions = Sessions(cluster.proxy_url, cfg.workload)
        planned = sessions.planned_turns()
        tally = sessions.tally

        def ended_share() -> float:
            return (tally.answered() + tally.lost) / max(1, planned)

        t0 = time.monotonic()
        traffic = asyncio.create_task(sessions.run())
        oversize = cfg.max_body_bytes + 4096
        bad_early = asyncio.create_task(send_bad_input(cluster.proxy_url, cluster.urls, oversize))

        # Kill replica 1 part-way through.
        limit = cfg.traffic_timeout_sec
        await _until(lambda: ended_share() >= cfg.kill_at or traffic.done(), limit)
        # Not while the bad input still goes to both replicas (a refused connection there would
        # be the kill's doing, not an answer to bad input).
        bad_early_report = await bad_early
        engine = cfg.gate_at == "engine"
        gate_at_kill = _gate_state(cluster, engine)
        in_flight = gate_at_kill["per_replica"][cluster.urls[1]].get("leases_active") or 0
        cluster.kill(1)
        killed_at = time.monotonic() - t0
        _log(f"killed replica 1 at {killed_at:.1f} s ({tally.answered()} turns ended, "
             f"{in_flight} leases on it)")  # fmt: skip

        def restart() -> None:
            time.sleep(cfg.down_sec)
            cluster.restart(1)

        restarted = loop.run_in_executor(None, restart)
        await _until(lambda: ended_share() >= 0.5 or traffic.done(), cfg.traffic_timeout_sec)
        rss["middle"] = cluster.proxy_rss_kib()
        _log(f"half of the turns ended; proxy RSS {rss['middle']} KiB")
        try:
            await asyncio.wait_for(traffic, cfg.traffic_timeout_sec)
        except TimeoutError:
            _log("traffic did not finish in time: turns still open count as lost")
            traffic.cancel()
        traffic_sec = time.monotonic() - t0
        _log(f"sessions done in {traffic_sec:.1f} s: {tally.as_dict()}")
        await restarted
        restarted_at = None
        healthy_again = await _until(
            lambda: (
                metric(
                    get_text(f"{cluster.proxy_url}/metrics"),
                    "session_gate_proxy_replica_healthy",
                    replica=cluster.urls[1],
                )
                == 1
            ),
            60,
        )
        restarted_at = time.monotonic() - t0
        _log(f"replica 1 serves again (proxy sees it healthy: {healthy_again})")
        bad_late_report = await send_bad_input(cluster.proxy_url, cluster.urls, oversize)
        fresh = await _fresh_sessions(cluster, 6)
        serving = await _engines_serving(cluster)
        await sessions.close()
        # Every session finished or abandoned: after one idle grace nothing may be held.
        await asyncio.sleep(cfg.idle_grace_sec + 2)
        gate_end = _gate_state(cluster, engine)
        rss["end"] = cluster.proxy_rss_kib()
    finally:
        await loop.run_in_executor(None, cluster.close)

    counts = tally.as_dict()
    killed = cluster.urls[1]
    requests = gate_end["proxy_requests"]
    sent_then_failed = sum(
        int(v)
        for k, v in requests.items()
        if f'replica="{killed}"' in k and 'status="502"' in k and "upstream_failed" in k
    )
    rerouted = sum(int(v) for k, v in requests.items() if 'outcome="rerouted"' in k)
    failed = tally.failed
    bad = {
        "during_traffic": bad_early_report.as_dict(),
        "after_restart": bad_late_report.as_dict(),
    }
    violations = bad_early_report.violations + bad_late_report.violations
    other_5xx = {s: n for s, n in failed.items() if s >= 500 and s != 502}
    targets = {
        "no_lost_turns": tally.lost == 0,
        "no_leases_held": gate_end["leases_active"] == 0,
        "no_reservations_held": gate_end["reservations_held"] == 0,
        "every_engine_serving": all(serving),
        "bad_input_documented_answers": not violations,
        # A turn the proxy could not send went elsewhere ("rerouted"); a 502 is only for a turn
        # already written to the killed replica's connection (it may have reached vLLM).
        "502_only_for_turns_sent_to_the_killed_replica": failed.get(502, 0) <= sent_then_failed,
        "no_other_5xx": not other_5xx,
        "rss_end_within_10pct_of_middle": rss["end"] <= 1.10 * rss["middle"],
        "fresh_sessions_ok": fresh["statuses"] == {"200": sum(fresh["statuses"].values())},
        "restarted_replica_takes_sessions": fresh["served_by_replica"][1] > 0,
        "killed_during_traffic": killed_at < traffic_sec,
    }
    return {
        "ok": all(targets.values()),
        "targets": targets,
        "sessions": cfg.workload.sessions,
        "turns_per_session": cfg.workload.turns,
        "gate_at": cfg.gate_at,
        **counts,
        "failed_examples": {str(k): v for k, v in tally.failed_examples.items()},
        "lost_examples": tally.lost_examples,
        "killed_replica_at_sec": round(killed_at, 1),
        "leases_on_killed_replica_at_kill": in_flight,
        "rerouted_before_sending": rerouted,
        "502_after_sending_to_killed_replica": sent_then_failed,
        "replica_back_at_sec": round(restarted_at, 1) if restarted_at else None,
        "traffic_sec": round(traffic_sec, 1),
        "leases_held_end": gate_end["leases_active"],
        "reservations_held_end": gate_end["reservations_held"],
        "gate_end": gate_end["per_replica"],
        "proxy_requests": gate_end["proxy_requests"],
        "pinned_sessions_end": gate_end["pinned_sessions"],
        "proxy_rss_kib": rss,
        "engines_serving": serving,
        "fresh_sessions_after_restart": fresh,
        "bad_input": bad,
        "wall_sec": round(time.monotonic() - started, 1),
    }
