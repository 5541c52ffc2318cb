"""The DP session pins (``dp_pin``) on vLLM's own balancing code, without engines.

``DPLBAsyncMPClient.get_core_engine_for_request`` is vLLM's real balancer; the client is built
without ``__init__`` (no engine processes) and given the state that method reads: two engines,
their load counts and the in-flight maps. Requests are real ``EngineCoreRequest`` objects, so the
tests see the very field vLLM routes by (``data_parallel_rank``). The engine test
(``test_engine_dp``) runs the same code on a real ``--data-parallel-size 2`` server.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter

import pytest
from session_gate.engine import dp_pin
from vllm import SamplingParams
from vllm.v1.engine import EngineCoreRequest
from vllm.v1.engine.core_client import DPLBAsyncMPClient

ENGINES = [b"\x00\x00", b"\x01\x00"]
_ids = itertools.count()


@pytest.fixture(autouse=True)
def installed():
    dp_pin.install()


def client(client_count: int = 1) -> DPLBAsyncMPClient:
    c = object.__new__(DPLBAsyncMPClient)
    c.core_engines = list(ENGINES)
    c.lb_engines = [[0, 0, 0.0] for _ in ENGINES]
    c.eng_start_index = 0
    c.reqs_in_flight = {}
    c.engine_inflight = Counter()
    c.client_count = client_count
    c.streaming_reqs = set()  # read by vLLM 0.33's balancer
    return c


def request(session_id: str | None = None, rank: int | None = None) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=f"r{next(_ids)}",
        prompt_token_ids=[1, 2, 3],
        mm_features=None,
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        arrival_time=0.0,
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=rank,
        session_id=session_id,
    )


def route(c: DPLBAsyncMPClient, req: EngineCoreRequest) -> int:
    """The rank vLLM sends ``req`` to; the request then ends (as vLLM's output path does)."""
    engine = c.get_core_engine_for_request(req)
    del c.reqs_in_flight[req.request_id]
    c.engine_inflight[engine] -= 1
    return ENGINES.index(engine)


def load(c: DPLBAsyncMPClient, rank: int, waiting: int) -> None:
    """The coordinator's snapshot says ``rank`` has ``waiting`` requests queued."""
    c.lb_engines[rank] = [waiting, 0, 0.9]


def test_first_turn_where_vllm_balances_later_turns_pinned():
    c, bare = client(), client()
    load(c, 0, 5)
    load(bare, 0, 5)
    original = DPLBAsyncMPClient.get_core_engine_for_request.__wrapped__
    first = route(c, request("s"))
    # vLLM's own balancer, unwrapped, on the same state: the same choice.
    assert first == ENGINES.index(original(bare, request("s")))
    assert first == 1
    load(c, 0, 0)
    load(c, 1, 50)  # vLLM alone would now pick rank 0
    assert route(c, request()) == 0
    for _ in range(5):
        turn = request("s")
        assert route(c, turn) == 1
        assert turn.data_parallel_rank == 1  # vLLM's own field carries the pin
    assert dp_pin.client_stats(c) == {"pins": 1, "placed": 1, "pinned": 5}


def test_sessions_spread_then_stay():
    c = client()
    homes = {s: route(c, request(s)) for s in "abcd"}
    assert set(homes.values()) == {0, 1}  # vLLM's balancer spread the first turns
    for _ in range(3):
        for s, home in homes.items():
            assert route(c, request(s)) == home


def test_a_request_that_names_a_rank_is_left_alone():
    c = client()
    home = route(c, request("s"))
    other = 1 - home
    named = request("s", rank=other)
    assert route(c, named) == other
    assert named.data_parallel_rank == other
    assert route(c, request("s")) == home  # the pin is unchanged


def test_requests_without_session_ids_are_untouched():
    c = client()
    reqs = [request() for _ in range(4)]
    assert [route(c, r) for r in reqs] == [0, 1, 0, 1]  # vLLM's round robin on idle engines
    assert all(r.data_parallel_rank is None for r in reqs)
    assert route(c, request("")) in (0, 1)  # an empty id is no id
    assert dp_pin.client_stats(c) == {}


def test_a_streaming_chunk_in_flight_is_left_to_vllm():
    c = client()
    first = request("s")
    engine = c.get_core_engine_for_request(first)
    chunk = request("s")
    chunk.request_id = first.request_id  # vLLM 0.32+ keeps a streaming request on its core
    load(c, ENGINES.index(engine), 50)
    c.get_core_engine_for_request(chunk)
    assert chunk.data_parallel_rank is None  # not pinned: vLLM routes it as it would alone
    assert dp_pin.client_stats(c) == {"pins": 1, "placed": 1}


def test_finish_forgets_the_pin():
    c = client()
    calls = []

    async def _call_utility_async(method, *args, engine):  # an engine's answer (no IPC here)
        calls.append((method, args, engine))
        return engine == ENGINES[0]

    c._call_utility_async = _call_utility_async
    route(c, request("s"))
    route(c, request("t"))
    assert asyncio.run(c.call_utility_async("session_gate_finish", "s")) is True
    # vLLM's DP client asks every engine core (each keeps its own gate) and answers the first's.
    assert calls == [("session_gate_finish", ("s",), engine) for engine in ENGINES]
    assert dp_pin.client_stats(c)["pins"] == 1
    assert dp_pin.client_stats(c)["forgotten"] == 1
    asyncio.run(c.call_utility_async("session_gate_stats", "json"))
    assert dp_pin.client_stats(c)["pins"] == 1  # other calls forget nothing


def test_pins_are_bounded_least_recently_used_first():
    pins = dp_pin.SessionPins(capacity=2)
    pins.put("a", 0)
    pins.put("b", 1)
    assert pins.get("a") == 0  # "b" is now the oldest
    pins.put("c", 1)
    assert (pins.get("a"), pins.get("b"), pins.get("c")) == (0, None, 1)
    assert len(pins) == 2 and pins.counters["evicted"] == 1
    assert pins.put("a", 1) == 0  # put keeps an existing pin
    pins.set("a", 1)
    assert pins.get("a") == 1
    with pytest.raises(ValueError, match="capacity"):
        dp_pin.SessionPins(capacity=0)


def test_the_authority_keeps_the_first_pin_and_forgets_on_finish():
    class Core:  # the engine core's __dict__ is all the authority uses
        pass

    core = Core()
    assert dp_pin.core_stats(core) is None
    assert dp_pin.session_gate_dp_pin(core, "s") is None
    assert dp_pin.session_gate_dp_pin(core, "s", 1) == 1
    assert dp_pin.session_gate_dp_pin(core, "s", 0) == 1  # another process came second
    assert dp_pin.session_gate_dp_pin(core, "s") == 1
    dp_pin.forget_in_core(core, "s")
    assert dp_pin.session_gate_dp_pin(core, "s") is None
    assert dp_pin.core_stats(core) == {
        "pins": 0,
        "asked_unknown": 2,
        "recorded": 1,
        "recorded_lost": 1,
        "asked_known": 1,
        "forgotten": 1,
    }
    for bad in ("", None, 3):
        with pytest.raises(ValueError, match="session_id"):
            dp_pin.session_gate_dp_pin(core, bad, 0)
    for bad in (-1, True, "1"):
        with pytest.raises(ValueError, match="rank"):
            dp_pin.session_gate_dp_pin(core, "s", bad)


async def test_the_lease_doors_call_one_ranks_gate_on_a_client_of_several_engine_cores():
    """``_Routes.call`` (the engine test sees it over HTTP): on a client that fans out to
    several cores, a release goes to the rank its lease id names, a cancel to every rank;
    probes, and any call on one core, go through vLLM's own ``call_utility_async``."""
    from types import SimpleNamespace

    from session_gate.engine.http_routes import _Routes

    calls = []

    class Core:
        def __init__(self, engines: int) -> None:
            self.core_engines = [f"e{k}" for k in range(engines)]

        async def call_utility_async(self, method, *args):
            calls.append((method, "all"))
            return True

        async def _call_utility_async(self, method, *args, engine):
            calls.append((method, engine, *args))
            return engine == "e1"

    several = _Routes(SimpleNamespace(engine_core=Core(2)), None)
    assert await several.call("session_gate_release", 7, "me") is True  # 7 = 3 × 2 + rank 1
    assert await several.call("session_gate_cancel", "t", "me") is True  # rank 1 withdrew it
    assert await several.call("session_gate_usage") is True
    assert calls == [
        ("session_gate_release", "e1", 3, "me"),
        ("session_gate_cancel", "e0", "t", "me"),
        ("session_gate_cancel", "e1", "t", "me"),
        ("session_gate_usage", "all"),
    ]
    calls.clear()
    assert await _Routes(SimpleNamespace(engine_core=Core(1)), None).call("session_gate_admit")
    assert calls == [("session_gate_admit", "all")]


# -- the lease doors' rank (dp_pin.rank_for_lease, dp_leases) ---------------------------------


def test_a_lease_goes_to_the_pin_or_the_least_loaded_rank_and_pins_it():
    c = client()
    c.lb_engines[0][:2] = [3, 1]  # rank 0 busier by the coordinator's counts
    assert dp_pin.least_loaded(c) == 1
    assert asyncio.run(dp_pin.rank_for_lease(c, "a")) == 1
    # Its turn follows the lease: vLLM's balancer is told the pinned rank.
    assert route(c, request("a")) == 1
    # Ties go to the rank with fewer pinned sessions, so idle ranks share new sessions.
    c.lb_engines[0][:2] = [0, 0]
    assert asyncio.run(dp_pin.rank_for_lease(c, "b")) == 0
    assert asyncio.run(dp_pin.rank_for_lease(c, "c")) in (0, 1)
    # This process's own requests in flight count (scaled by the client count), as in vLLM.
    c.engine_inflight[ENGINES[0]] = 5
    assert dp_pin.least_loaded(c) == 1
    # Reading the load changes none of vLLM's counters.
    assert c.lb_engines == [[0, 0, 0.0], [0, 0, 0.0]] and c.engine_inflight[ENGINES[1]] == 0


def test_with_several_api_servers_the_authority_decides_a_leases_rank():
    c = client(client_count=2)
    calls = []

    async def utility(method, session_id, rank, engine):
        calls.append((method, session_id, rank, engine))
        # The authority already pinned "taken" to rank 0; it knows nothing of the others.
        known = {"taken": 0}.get(session_id)
        return known if rank is None or known is not None else rank

    c._call_utility_async = utility
    assert asyncio.run(dp_pin.rank_for_lease(c, "taken")) == 0
    c.lb_engines[1][:2] = [9, 9]
    assert asyncio.run(dp_pin.rank_for_lease(c, "new")) == 0
    assert [call[:3] for call in calls] == [
        ("session_gate_dp_pin", "taken", None),
        ("session_gate_dp_pin", "new", None),
        ("session_gate_dp_pin", "new", 0),
    ]
    assert all(call[3] == ENGINES[0] for call in calls)  # the authority is the first core


def test_lease_ids_name_their_rank_and_renewals_add_up():
    from session_gate.engine import dp_leases

    for lease, rank in [(0, 0), (7, 1), (123456789, 2)]:
        encoded = dp_leases.encode_lease(lease, rank, 3)
        assert dp_leases.decode_lease(encoded, 3) == (rank, lease)
    assert dp_leases.decode_lease("x", 2) == (0, "x")  # rank 0's gate names the bad value
    assert dp_leases.decode_lease(-1, 2) == (0, -1)
    merged = dp_leases.merge_renewals(
        [
            {"lease_ttl_sec": 30.0, "leases": 2, "pending": 1},
            {"lease_ttl_sec": 20.0, "leases": 1, "pending": 0},
        ]
    )
    assert merged == {"lease_ttl_sec": 20.0, "leases": 3, "pending": 1}
