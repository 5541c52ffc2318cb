"""``make bench-proxy``: what ``session-gate proxy`` adds per request on loopback, gate open.

Starts ``vllm serve`` (tiny CPU model, both session_gate plugins) and the proxy (release build),
then sends the same small token-id completion (``max_tokens=1``) alternately straight to vLLM and
through the proxy as a gated session (the gate stays open: the cache is nearly empty), one at a
time over keep-alive connections. Prints p50/p99 of both and of the difference, and last one
JSON line. Target: ≤ 1 ms added at p50.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from session_gate.lab.engine.serve import proxy_binary, start_proxy, start_vllm, stop


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _post(conn: http.client.HTTPConnection, path: str, body: bytes) -> float:
    started = time.perf_counter()
    conn.request("POST", path, body, {"content-type": "application/json"})
    r = conn.getresponse()
    data = r.read()
    elapsed = time.perf_counter() - started
    if r.status != 200:
        raise RuntimeError(f"{path}: {r.status} {data[:300]!r}")
    return elapsed


def run(n: int, prompt_tokens: int, proxy_bin: str | None = None, proxy_args=()) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="session-gate-bench-proxy-"))
    vllm_proc, vllm_url = start_vllm(workdir, num_blocks=1024, max_model_len=4096)
    proxy_proc = None
    try:
        if proxy_bin is None:
            proxy_bin = str(proxy_binary(release=True))
        proxy_proc, proxy_url = start_proxy(proxy_bin, vllm_url, workdir, proxy_args)
        port = int(proxy_url.rsplit(":", 1)[1])
        vport = int(vllm_url.rsplit(":", 1)[1])
        direct = http.client.HTTPConnection("127.0.0.1", vport)
        proxied = http.client.HTTPConnection("127.0.0.1", port)
        prompt = list(range(10, 10 + prompt_tokens))
        body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 1}).encode()
        for _ in range(20):  # warm up both paths (and the prefix cache)
            _post(direct, "/v1/completions", body)
            _post(proxied, "/sess/bench/v1/completions", body)
        d, p = [], []
        for i in range(n):
            # Alternate the order so drift affects both sides alike.
            if i % 2:
                d.append(_post(direct, "/v1/completions", body))
                p.append(_post(proxied, "/sess/bench/v1/completions", body))
            else:
                p.append(_post(proxied, "/sess/bench/v1/completions", body))
                d.append(_post(direct, "/v1/completions", body))
        diffs = [b - a for a, b in zip(d, p, strict=True)]
        ms = 1000.0
        result = {
            "bench": "proxy_overhead",
            "requests": n,
            "prompt_tokens": prompt_tokens,
            "direct_p50_ms": _pct(d, 0.5) * ms,
            "direct_p99_ms": _pct(d, 0.99) * ms,
            "proxy_p50_ms": _pct(p, 0.5) * ms,
            "proxy_p99_ms": _pct(p, 0.99) * ms,
            "overhead_p50_ms": (_pct(p, 0.5) - _pct(d, 0.5)) * ms,
            "overhead_p99_ms": (_pct(p, 0.99) - _pct(d, 0.99)) * ms,
            "paired_overhead_median_ms": statistics.median(diffs) * ms,
            "target_p50_ms": 1.0,
            "machine": f"{platform.machine()} {os.cpu_count()} cpus, {platform.system()}",
        }
        return result
    finally:
        if proxy_proc is not None:
            stop(proxy_proc)
        stop(vllm_proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument(
        "--proxy-bin",
        help="run this session-gate binary instead of building target/release/session-gate",
    )
    ap.add_argument(
        "--proxy-arg",
        action="append",
        default=[],
        help="extra `session-gate proxy` argument, repeatable, e.g. --proxy-arg=--usage-cache-ms=0",
    )
    args = ap.parse_args()
    result = run(args.requests, args.prompt_tokens, args.proxy_bin, args.proxy_arg)
    for k, v in result.items():
        if k.endswith("_ms"):
            print(f"{k:28s} {v:8.3f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
