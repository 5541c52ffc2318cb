"""A minimal multi-turn agent loop through ``session-gate proxy`` with the ``openai`` client.

Each agent session is one conversation: every turn re-sends the whole history plus the last tool
result (the prompt grows every turn, as in agentic RL rollouts). The only session-gate specific
parts are the ``x-session-id`` header, which tells the proxy which session a turn belongs to (so
it can gate it and pin it to one replica), and ``POST /sess/{id}/finish`` at the end, which frees
the session's reservation at once instead of after its idle grace.

Run, with ``vllm serve`` (``VLLM_PLUGINS=session_gate``) and ``session-gate proxy --replica
http://127.0.0.1:8000`` (listening on 127.0.0.1:8100 by default) running::

    python examples/agent_loop.py --proxy http://127.0.0.1:8100 --model <served model name>

Prints one line per turn and a JSON summary last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import urllib.request

from openai import AsyncOpenAI


def run_tool(session: int, turn: int, reply: str) -> str:
    """The agent's tool: here a stand-in that answers at once with a little text."""
    return f"tool result {turn} for agent {session}: observed {len(reply.split())} words"


def finish_session(proxy: str, session_id: str) -> None:
    """Tell the proxy the session is over, so its reservation is freed now."""
    request = urllib.request.Request(f"{proxy}/sess/{session_id}/finish", method="POST")
    with urllib.request.urlopen(request, timeout=30) as response:
        response.read()


async def agent(
    client: AsyncOpenAI, proxy: str, model: str, session: int, turns: int, max_tokens: int
) -> dict:
    session_id = f"agent-{session}"
    messages = [
        {"role": "system", "content": "You are an agent that solves tasks with tools."},
        {"role": "user", "content": f"Task {session}: count the words in every tool result."},
    ]
    latencies = []
    for turn in range(1, turns + 1):
        started = time.perf_counter()
        response = await client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=max_tokens,
            extra_headers={"x-session-id": session_id},
        )
        latencies.append(time.perf_counter() - started)
        reply = response.choices[0].message.content or ""
        print(
            f"{session_id} turn {turn}: {response.usage.prompt_tokens} prompt tokens, "
            f"{latencies[-1]:.3f} s",
            flush=True,
        )
        messages.append({"role": "assistant", "content": reply})
        messages.append({"role": "user", "content": run_tool(session, turn, reply)})
    await asyncio.to_thread(finish_session, proxy, session_id)
    return {"session_id": session_id, "turns": turns, "latency_sec": latencies}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--proxy", default="http://127.0.0.1:8100", help="the proxy's base URL")
    parser.add_argument("--model", required=True, help="the served model name")
    parser.add_argument("--sessions", type=int, default=2)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()
    proxy = args.proxy.rstrip("/")
    # The proxy forwards Authorization untouched; vLLM without --api-key accepts any key.
    client = AsyncOpenAI(base_url=f"{proxy}/v1", api_key="unused")
    results = await asyncio.gather(
        *(
            agent(client, proxy, args.model, s, args.turns, args.max_tokens)
            for s in range(args.sessions)
        )
    )
    await client.close()
    print(json.dumps({"sessions": len(results), "turns": sum(r["turns"] for r in results)}))


if __name__ == "__main__":
    asyncio.run(main())
