"""Malformed, oversize and wrong-type requests to every route of the proxy and of vLLM's server
(its ``/v1`` routes, ``/tokenize`` and the plugin's ``/session_gate/v1/*``), sent while the soak's
sessions run. Each must get a documented answer: a 4xx (400 bad input, 404 no such route or
model, 405 wrong method, 413 too large, 422 vLLM's validation), or a 2xx where the request is in
fact valid for that route (a probe ignores completion fields, ``/tokenize`` has no length limit,
vLLM's ``/metrics`` answers any method). A 5xx, a dropped connection or a timeout is a
violation."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field

import httpx

PROXY_POST = ["/v1/completions", "/v1/chat/completions", "/sess/{s}/v1/completions",
              "/sess/{s}/v1/chat/completions", "/sess/{s}/finish"]  # fmt: skip
PROXY_GET = ["/v1/models", "/sess/{s}/v1/models", "/metrics", "/health"]
VLLM_POST = ["/v1/completions", "/v1/chat/completions", "/tokenize",
             "/session_gate/v1/usage", "/session_gate/v1/probe", "/session_gate/v1/forget",
             "/session_gate/v1/admit", "/session_gate/v1/release", "/session_gate/v1/cancel",
             "/session_gate/v1/finish", "/session_gate/v1/renew"]  # fmt: skip
VLLM_GET = ["/v1/models", "/health", "/metrics", "/session_gate/v1/stats"]
UNKNOWN = ["/v1/nope", "/sess/{s}/v2/completions", "/session_gate/v1/nope", "/../etc/passwd"]


def _js(**fields) -> bytes:
    return json.dumps(fields).encode()


def bodies(oversize: int) -> list[tuple[str, str, bytes]]:
    """``(case, content-type, body)`` for POST routes."""
    j = "application/json"
    return [
        ("empty", j, b""),
        ("malformed_json", j, b'{"model": "tiny", "prompt": [1, 2'),
        ("json_array", j, b"[1, 2, 3]"),
        ("json_string", j, b'"hello"'),
        ("prompt_wrong_type", j, _js(model="tiny", prompt={"a": 1})),
        ("prompt_negative_ids", j, _js(model="tiny", prompt=[-1, -2])),
        ("prompt_huge_ids", j, _js(model="tiny", prompt=[2**40])),
        ("token_past_vocab", j, _js(model="tiny", prompt=[99999999], token_ids=[99999999])),
        ("messages_wrong_type", j, _js(model="tiny", messages="hi")),
        ("max_tokens_wrong_type", j, _js(model="tiny", prompt=[7, 8], max_tokens="many")),
        ("unknown_model", j, _js(model="nope", prompt=[7, 8])),
        ("ids_wrong_type", j, _js(session_id={"x": 1}, lease="x", ticket=[], client_id=5)),
        ("binary_junk", "application/octet-stream", bytes(range(256)) * 3 + b"\x01"),
        ("wrong_content_type", "text/plain", b"prompt=hello"),
        ("oversize", j, _js(model="tiny", prompt="w1 " * (oversize // 3))),
    ]


@dataclass
class BadInputReport:
    statuses: Counter = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    sent: int = 0

    def as_dict(self) -> dict:
        return {
            "requests": self.sent,
            "statuses": {str(k): v for k, v in sorted(self.statuses.items(), key=str)},
            "violations": len(self.violations),
            "violation_examples": self.violations[:10],
        }


async def send_bad_input(
    proxy_url: str, replica_urls: list[str], oversize: int, session: str = "soak-bad"
) -> BadInputReport:
    """Every case to every route, a few at a time (they run beside the sessions)."""
    import asyncio

    report = BadInputReport()
    jobs: list[tuple[str, str, str, str, str, bytes]] = []  # target, method, route, case, ct, b
    targets = [("proxy", proxy_url, PROXY_POST, PROXY_GET)] + [
        (f"replica{i}", url, VLLM_POST, VLLM_GET) for i, url in enumerate(replica_urls)
    ]
    for name, base, posts, gets in targets:
        for route in posts:
            for case, ct, body in bodies(oversize):
                jobs.append((name, base, "POST", route, case, ct, body))  # type: ignore[arg-type]
            jobs.append((name, base, "PUT", route, "wrong_method", "application/json", b"{}"))  # type: ignore[arg-type]
        for route in gets:
            jobs.append((name, base, "DELETE", route, "wrong_method", "application/json", b"{}"))  # type: ignore[arg-type]
        for route in UNKNOWN:
            jobs.append((name, base, "POST", route, "unknown_route", "application/json", b"{}"))  # type: ignore[arg-type]
    limit = asyncio.Semaphore(8)
    async with httpx.AsyncClient(timeout=120) as http:

        async def one(job) -> None:
            name, base, method, route, case, ct, body = job
            path = route.replace("{s}", session)
            async with limit:
                report.sent += 1
                try:
                    r = await http.request(
                        method, base + path, content=body, headers={"content-type": ct}
                    )
                    status = r.status_code
                except httpx.HTTPError as e:
                    report.statuses["no_answer"] += 1
                    report.violations.append(f"{name} {method} {path} {case}: {e!r}"[:300])
                    return
            report.statuses[status] += 1
            if not 200 <= status < 500:
                report.violations.append(f"{name} {method} {path} {case}: {status} {r.text[:200]}")

        await asyncio.gather(*(one(j) for j in jobs))
    return report
