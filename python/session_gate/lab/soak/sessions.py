"""The soak run's sessions: many concurrent multi-turn sessions through the proxy, driven by the
official ``openai`` client (completions with token-id prompts and chat with text, streaming and
not), with the misbehaviours a rollout fleet produces:

- ``normal``: every turn, then ``POST /sess/{id}/finish``;
- ``disconnect``: one streaming turn is dropped by the client after its first chunk;
- ``abandon``: the session stops after a few turns and never calls finish (its reservation must
  go when its idle grace ends);
- ``storm``: one turn is sent as a burst of identical concurrent requests (a scaffold retrying
  into a timeout): every attempt must get an answer (completed, or 409 for a preempted one).

Every turn is counted exactly once in a :class:`Tally`: completed, failed cleanly (an HTTP
status), broken (an answer began, then its stream broke: it was on the replica that was killed),
disconnected (by the client, on purpose) or lost (no answer at all: timeout or no connection)."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from dataclasses import dataclass, field

import httpx

from session_gate.lab.engine.tiny_tokenizer import word_ids, words


@dataclass
class Tally:
    """Every turn's fate, and when it happened."""

    sent: int = 0
    completed: int = 0
    failed: Counter = field(default_factory=Counter)
    broken: int = 0
    disconnected: int = 0
    lost: int = 0
    lost_examples: list[str] = field(default_factory=list)
    failed_examples: dict[int, str] = field(default_factory=dict)
    sessions_finished: int = 0
    sessions_abandoned: int = 0
    finish_failed: int = 0

    def answered(self) -> int:
        return self.completed + sum(self.failed.values()) + self.broken + self.disconnected

    def as_dict(self) -> dict:
        return {
            "turns_sent": self.sent,
            "completed": self.completed,
            "failed_cleanly": {str(k): v for k, v in sorted(self.failed.items())},
            "broken_streams": self.broken,
            "client_disconnects": self.disconnected,
            "lost": self.lost,
            "sessions_finished": self.sessions_finished,
            "sessions_abandoned": self.sessions_abandoned,
            "finish_failed": self.finish_failed,
        }


@dataclass
class Workload:
    sessions: int = 200
    turns: int = 6
    first_tokens: int = 96
    turn_tokens: int = 32
    max_tokens: int = 8
    storm_sessions: int = 2
    storm_size: int = 8
    disconnect_share: float = 0.1
    abandon_share: float = 0.1
    think_sec: float = 0.5
    ramp_sec: float = 5.0
    turn_timeout: float = 600.0
    seed: int = 0

    def role(self, i: int) -> str:
        """Storms first, then disconnects and abandons spread evenly over the rest."""
        if i < self.storm_sessions:
            return "storm"
        x = ((i - self.storm_sessions) * 0.618034) % 1.0  # golden-ratio spread
        if x < self.disconnect_share:
            return "disconnect"
        if x < self.disconnect_share + self.abandon_share:
            return "abandon"
        return "normal"


class Sessions:
    """Runs the workload against ``proxy_url``; ``tally`` fills as turns end."""

    def __init__(self, proxy_url: str, workload: Workload, api_key: str = "unused") -> None:
        from openai import AsyncOpenAI

        self.proxy_url = proxy_url
        self.w = workload
        self.tally = Tally()
        limits = httpx.Limits(max_connections=4 * workload.sessions + 64)
        self.http = httpx.AsyncClient(limits=limits, timeout=workload.turn_timeout)
        self.openai = AsyncOpenAI(
            base_url=f"{proxy_url}/v1",
            api_key=api_key,
            max_retries=0,
            timeout=workload.turn_timeout,
            http_client=self.http,
        )

    async def close(self) -> None:
        await self.http.aclose()

    def planned_turns(self) -> int:
        return self.w.sessions * self.w.turns

    async def run(self) -> Tally:
        await asyncio.gather(*(self._session(i) for i in range(self.w.sessions)))
        return self.tally

    async def _session(self, i: int) -> None:
        w = self.w
        rng = random.Random(w.seed * 104729 + i)
        await asyncio.sleep(rng.uniform(0, w.ramp_sec))
        sid = f"soak-{w.seed}-{i}"
        client = self.openai.with_options(base_url=f"{self.proxy_url}/sess/{sid}/v1")
        role = w.role(i)
        chat = i % 3 == 0
        history_ids = word_ids(1000 * i, w.first_tokens)
        messages = [{"role": "user", "content": words(1000 * i, w.first_tokens)}]
        abandon_at = rng.randint(1, max(1, w.turns - 1))
        for t in range(w.turns):
            if role == "abandon" and t == abandon_at:
                self.tally.sessions_abandoned += 1
                return
            drop = role == "disconnect" and t == w.turns // 2
            stream = drop or (i + t) % 2 == 0
            burst = w.storm_size if role == "storm" and t == 1 else 1

            label = f"{sid} turn {t}"
            replies = await asyncio.gather(
                *(
                    self._counted(client, chat, history_ids, messages, stream, drop, label)
                    for _ in range(burst)
                )
            )
            reply = next((r for r in replies if r is not None), "")
            history_ids.extend(word_ids(1000 * i + 100 * (t + 1), w.turn_tokens))
            messages.append({"role": "assistant", "content": reply or "w1"})
            messages.append(
                {"role": "user", "content": words(1000 * i + 100 * (t + 1), w.turn_tokens)}
            )
            await asyncio.sleep(rng.uniform(0, w.think_sec))
        try:
            r = await self.http.post(f"{self.proxy_url}/sess/{sid}/finish")
            if r.status_code == 200:
                self.tally.sessions_finished += 1
            else:
                self.tally.finish_failed += 1
        except httpx.HTTPError:
            self.tally.finish_failed += 1

    async def _counted(
        self, client, chat, history_ids, messages, stream, drop, label
    ) -> str | None:
        """One request, counted as sent and then as its ending."""
        from openai import APIConnectionError, APIStatusError, APITimeoutError

        self.tally.sent += 1
        try:
            return await self._turn(client, chat, history_ids, messages, stream, drop)
        except APIStatusError as e:
            self.tally.failed[e.status_code] += 1
            self.tally.failed_examples.setdefault(e.status_code, str(e)[:300])
        except (APITimeoutError, APIConnectionError) as e:
            self.tally.lost += 1
            if len(self.tally.lost_examples) < 5:
                self.tally.lost_examples.append(f"{label}: {e!r}"[:300])
        return None

    async def _turn(
        self,
        client,
        chat: bool,
        history_ids: list[int],
        messages: list[dict],
        stream: bool,
        drop: bool,
    ) -> str | None:
        """One request; counts its ending (a status error propagates to the caller)."""
        w = self.w
        if chat:
            call = client.chat.completions.create(
                model="tiny", messages=list(messages), max_tokens=w.max_tokens, stream=stream
            )
        else:
            call = client.completions.create(
                model="tiny", prompt=list(history_ids), max_tokens=w.max_tokens, stream=stream
            )
        answer = await call
        if not stream:
            self.tally.completed += 1
            return answer.choices[0].message.content if chat else answer.choices[0].text
        text, got_any = [], False
        try:
            async for chunk in answer:
                got_any = True
                if chunk.choices:
                    c = chunk.choices[0]
                    text.append((c.delta.content or "") if chat else (c.text or ""))
                if drop:
                    # The client goes away mid-stream (closing the connection).
                    await answer.close()
                    self.tally.disconnected += 1
                    return None
        except Exception:  # the stream broke after it began (its replica died)
            self.tally.broken += 1
            return None
        if drop and not got_any:
            self.tally.disconnected += 1
            return None
        self.tally.completed += 1
        return "".join(text)
