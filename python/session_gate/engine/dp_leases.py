"""The engine gate's lease doors on a data-parallel server: each call reaches the rank it is
about, not every rank.

With ``vllm serve --data-parallel-size N`` and vLLM's internal load balancing each engine core
(DP rank) has its own engine gate, and vLLM's client sends a utility call to every core and
answers with the first one's. The lease doors (admit, release, cancel, renew: the
``/session_gate/v1/*`` routes, the ``--middleware``, ``session-gate proxy --gate-at engine``)
need one gate per call instead:

- **admit** goes to the session's rank (``dp_pin.rank_for_lease``: its pin, the authority's, or
  the least-loaded rank, pinned there), so the lease commits the cache the turn will run on, and
  the turn's request, which carries the session id, follows the pin. The answer says ``rank``
  (a client that forwards the turn without its session id sends ``X-data-parallel-rank``), and
  its ``lease`` id is the rank's own id × N + rank, so that a release finds its rank again;
- **release** goes to the rank its lease id names;
- **cancel** and **renew** go to every rank (a ticket's rank is not in it; a client's leases may
  sit on several ranks): cancel answers whether any rank withdrew the ticket, renew sums the
  leases and pending admits and keeps the shortest TTL.

Without data parallelism nothing here runs (``http_routes._Routes.call`` calls the engine as
before).
"""

from __future__ import annotations

import asyncio
from typing import Any

from session_gate.engine import dp_pin


def encode_lease(lease: int, rank: int, ranks: int) -> int:
    """A rank's lease id as the DP server's lease doors answer it."""
    return lease * ranks + rank


def decode_lease(lease: Any, ranks: int) -> tuple[int, Any]:
    """``(rank, the rank's own lease id)`` of a DP server's lease id; a value that is not a
    lease id goes to rank 0 as it is, for that gate's own error."""
    if isinstance(lease, bool) or not isinstance(lease, int) or lease < 0:
        return 0, lease
    return lease % ranks, lease // ranks


def merge_renewals(answers: list[Any]) -> Any:
    """Every rank's renew answer as one: leases and pending admits summed, the shortest TTL."""
    dicts = [a for a in answers if isinstance(a, dict)]
    if not dicts:
        return answers[0]
    merged = dict(dicts[0])
    for key in ("leases", "pending"):
        if all(isinstance(d.get(key), int) for d in dicts):
            merged[key] = sum(d[key] for d in dicts)
    ttls = [d["lease_ttl_sec"] for d in dicts if isinstance(d.get("lease_ttl_sec"), int | float)]
    if ttls:
        merged["lease_ttl_sec"] = min(ttls)
    return merged


async def each_rank(client: Any, method: str, *args: Any) -> list[Any]:
    """``method`` on every engine core of a DP engine client, one answer per rank in rank
    order."""
    engines = client.core_engines
    return list(
        await asyncio.gather(
            *(client._call_utility_async(method, *args, engine=engine) for engine in engines)
        )
    )


async def call(client: Any, method: str, *args: Any) -> Any:
    """A lease door's ``method`` on a DP engine client (the module docstring)."""
    engines = client.core_engines
    ranks = len(engines)

    async def on(rank: int, *call_args: Any) -> Any:
        return await client._call_utility_async(method, *call_args, engine=engines[rank])

    if method == "session_gate_admit":
        session_id = args[0]
        rank = await dp_pin.rank_for_lease(client, session_id) if isinstance(session_id, str) else 0
        answer = await on(rank, *args)
        if isinstance(answer, dict):
            answer = {**answer, "rank": rank}
            if isinstance(answer.get("lease"), int):
                answer["lease"] = encode_lease(answer["lease"], rank, ranks)
        return answer
    if method == "session_gate_release":
        rank, lease = decode_lease(args[0], ranks)
        return await on(rank, lease, *args[1:])
    answers = await each_rank(client, method, *args)
    if method == "session_gate_renew":
        return merge_renewals(answers)
    return any(answers) if all(isinstance(a, bool) for a in answers) else answers[0]
