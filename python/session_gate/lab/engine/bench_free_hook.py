"""``python -m session_gate.lab.engine.bench_free_hook``: what the engine gate's wrap of vLLM's
``Scheduler._free_request`` (``session_gate.engine.gate_binding``) adds to the engine loop for a
request WITHOUT a bound lease, which is every request but the middleware's gated ones.

It times, in one process, a stand-in ``_free_request`` that does nothing, called bare and through
the wrapper, on a real ``vllm.v1.request.Request`` (plain ``SamplingParams``: ``extra_args`` is
None, as vLLM's own requests have it; and one with an ``extra_args`` of another key). The added
time is the wrapper's frame and its two checks, in ns per finished request: a floor (warm
caches, a tight loop), printed as one JSON line, the best of ``--rounds``. It lives beside the
other engine benchmarks because it imports vLLM.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any


def _per_call_ns(fn: Any, scheduler: Any, request: Any, n: int) -> float:
    started = time.perf_counter_ns()
    for _ in range(n):
        fn(scheduler, request)
    return (time.perf_counter_ns() - started) / n


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=200_000)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)

    from vllm import SamplingParams
    from vllm.v1.request import Request

    from session_gate.engine.gate_binding import _wrap_free_request

    def free_request(self: Any, request: Any, delay_free_blocks: bool = False) -> None:
        return None

    wrapped = _wrap_free_request(free_request)

    class Scheduler:  # the wrapper reads nothing of the scheduler for an unbound request
        pass

    scheduler = Scheduler()
    out: dict[str, float] = {}
    for name, extra in (("no_extra_args", None), ("other_extra_args", {"other": 1})):
        request = Request(f"r-{name}", [1, 2, 3], SamplingParams(max_tokens=1), None)
        request.sampling_params.extra_args = extra
        best = {"bare": float("inf"), "wrapped": float("inf")}
        for _ in range(args.rounds):
            best["bare"] = min(
                best["bare"], _per_call_ns(free_request, scheduler, request, args.calls)
            )
            best["wrapped"] = min(
                best["wrapped"], _per_call_ns(wrapped, scheduler, request, args.calls)
            )
        out[f"{name}_bare_ns"] = round(best["bare"], 1)
        out[f"{name}_wrapped_ns"] = round(best["wrapped"], 1)
        out[f"{name}_added_ns"] = round(best["wrapped"] - best["bare"], 1)
    print(json.dumps(out, sort_keys=True))


if __name__ == "__main__":
    main()
