"""The seed's deployment: an in-process proxy of the kind RL frameworks use, with the gate inside.

RL frameworks drive rollouts through an async "server manager" living in the trainer's process:
it picks a vLLM replica for each request (sticky per session, so the session's prefix stays in
one replica's cache), calls it with token ids, and hands the output token ids back to the agent
loop. The session gate sits inside that manager, in front of the replica call: one
``SessionGate`` per replica, probing it over HTTP (``HttpProbe``; the replica runs ``vllm serve``
with ``VLLM_PLUGINS=session_gate``), and every turn is wrapped in ``gate.admit``.

Run, with one or more ``vllm serve`` replicas running::

    python examples/in_process_proxy.py --replica http://127.0.0.1:8000 --model <name>

Prints one line per turn and a JSON summary last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random

from openai import AsyncOpenAI
from session_gate import GateConfig, HttpProbe, SessionGate


class Replica:
    """One ``vllm serve``: its OpenAI client, its gate and its sessions in flight."""

    def __init__(self, base_url: str, config: GateConfig) -> None:
        self.base_url = base_url.rstrip("/")
        self.client = AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key="unused")
        self.probe = HttpProbe(self.base_url)
        self.gate = SessionGate(probe=self.probe, config=config)
        self.in_flight = 0

    async def aclose(self) -> None:
        await self.client.close()
        await self.probe.aclose()


class ServerManager:
    """Picks a replica per session (sticky; new sessions go to the least busy replica) and
    sends each turn through that replica's gate."""

    def __init__(self, replica_urls: list[str], model: str, config: GateConfig) -> None:
        self.replicas = [Replica(url, config) for url in replica_urls]
        self.model = model
        self.pinned: dict[str, Replica] = {}
        self.admissions: dict[str, int] = {}

    def _pick(self, session_id: str) -> Replica:
        replica = self.pinned.get(session_id)
        if replica is None:
            replica = min(self.replicas, key=lambda r: r.in_flight)
            self.pinned[session_id] = replica
        return replica

    async def generate(self, session_id: str, prompt_ids: list[int], max_tokens: int) -> list[int]:
        """One turn: wait for admission, call the replica, return the output token ids."""
        replica = self._pick(session_id)
        # The whole prompt goes to the gate; its length plus max_tokens is the turn's working
        # set (without max_tokens the gate counts its default_max_tokens knob instead).
        async with replica.gate.admit(session_id, prompt_ids, max_tokens=max_tokens) as lease:
            self.admissions[lease.reason] = self.admissions.get(lease.reason, 0) + 1
            replica.in_flight += 1
            try:
                response = await replica.client.completions.create(
                    model=self.model,
                    prompt=prompt_ids,
                    max_tokens=max_tokens,
                    extra_body={"return_token_ids": True},
                )
            finally:
                replica.in_flight -= 1
        return list(response.choices[0].token_ids)

    async def finish(self, session_id: str) -> None:
        """The rollout of this session is over: free its reservation now."""
        replica = self.pinned.pop(session_id, None)
        if replica is not None:
            await replica.gate.finish_session(session_id)

    async def aclose(self) -> None:
        for replica in self.replicas:
            await replica.aclose()


async def rollout(
    manager: ServerManager, session: int, turns: int, max_tokens: int, vocab: int
) -> int:
    """An agent loop on token ids: prompt, model output, tool output, again."""
    rng = random.Random(session)
    session_id = f"rollout-{session}"
    prompt = [rng.randrange(100, vocab) for _ in range(200)]
    for turn in range(1, turns + 1):
        output = await manager.generate(session_id, prompt, max_tokens)
        tool = [rng.randrange(100, vocab) for _ in range(50)]
        print(f"{session_id} turn {turn}: {len(prompt)} prompt tokens", flush=True)
        prompt = prompt + output + tool
    await manager.finish(session_id)
    return turns


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replica", action="append", required=True, help="vllm serve base URL")
    parser.add_argument("--model", required=True, help="the served model name")
    parser.add_argument("--sessions", type=int, default=3)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096, help="token ids are drawn below this")
    args = parser.parse_args()
    # SESSION_GATE_* environment variables override the seed's defaults.
    manager = ServerManager(args.replica, args.model, GateConfig.from_env())
    try:
        turns = await asyncio.gather(
            *(
                rollout(manager, s, args.turns, args.max_tokens, args.vocab)
                for s in range(args.sessions)
            )
        )
    finally:
        await manager.aclose()
    summary = {"sessions": len(turns), "turns": sum(turns), "admissions": manager.admissions}
    print(json.dumps(summary))


if __name__ == "__main__":
    asyncio.run(main())
