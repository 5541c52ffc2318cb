"""``python -m session_gate.lab.engine.bench_gate_footprint``: the engine gate's admit + release on
cold caches, outside the engine, to test why the pair costs 30-50x more in vLLM's engine loop
than in a tight loop (README, "The engine-loop cost, third round").

The hypothesis: between two utility calls the engine thread runs vLLM (ZMQ, msgpack, Python
dispatch, torch), which evicts our code and data, so a call costs about the distinct cache lines
(and pages) it touches times a miss, not its instructions. This runs the real native
``EngineGateBook`` (built as the engine's driver builds it, over a real vLLM ``BlockPool`` in
this process: ``session_gate.lab.engine.inprocess``) and calls its ``admit`` / ``release`` as vLLM
does (the utility call's own arguments: fresh ``str`` ids, a 32-token list, gate open), with a
cache-thrashing step before every call, one of:

- ``none``: nothing (a tight loop: warm caches, the floor);
- ``walk``: write one byte of every 64-byte line of a 64 MB buffer (data caches and the TLB);
- ``torch``: a 256x256 float32 matmul and a few element-wise ops on one thread (torch's
  dispatcher code and ~1 MB of data, as a CPU engine's step touches);
- ``python``: a JSON round trip of a 2,000-entry dict and ``inspect.signature`` of 50
  functions (interpreter code and objects, as vLLM's utility dispatch runs);
- ``all``: the three in a row.

The modes take turns, ten pairs at a time (so the VM's drift hits each alike), and beside the pair
each mode also times, under the same thrash, the engine's O(1) usage probe (``engine_us`` of
``EngineState.usage_answer``, the same baseline ``make bench-engine-gate`` divides by) and a
native call that does nothing (a getter of the book: the cost of entering our code at all).
Printed: one JSON line, each mode's p50 in us and its ratios to ``none`` and to the usage probe.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

MODES = ("none", "walk", "torch", "python", "all")
WALK_BYTES = 64 * 1024 * 1024
#: Pairs per turn of a mode, and unrecorded rounds first.
BLOCK = 10
WARMUP = 2


def _thrashers() -> dict[str, Callable[[], None]]:
    import numpy as np
    import torch

    torch.set_num_threads(1)
    buf = np.zeros(WALK_BYTES, dtype=np.uint8)
    lines = buf[::64]
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    doc = {f"key-{i}": [i, str(i), {"x": i * 0.5}] for i in range(2000)}
    funcs = [
        getattr(mod, name)
        for mod in (json, statistics, inspect)
        for name in dir(mod)
        if inspect.isfunction(getattr(mod, name))
    ][:50]

    def walk() -> None:
        np.add(lines, 1, out=lines)  # in place: one write per 64-byte line

    def matmul() -> None:
        c = torch.mm(a, b)
        (c.relu_() * 0.5 + 1.0).sum()

    def python() -> None:
        json.loads(json.dumps(doc))
        for f in funcs:
            inspect.signature(f)

    def everything() -> None:
        walk()
        matmul()
        python()

    return {
        "none": lambda: None,
        "walk": walk,
        "torch": matmul,
        "python": python,
        "all": everything,
    }


def _book(num_blocks: int, block_size: int) -> tuple[Any, Any]:
    """The engine's own ``EngineGateBook`` over a real ``BlockPool``, as ``gate_driver`` builds
    it (default knobs), and the engine state whose usage probe is the baseline."""
    from session_gate.engine.gate_driver import native_book
    from session_gate.engine.methods import _load_native
    from session_gate.lab.engine.inprocess import engine_state, make_kv_cache_manager

    native, error = _load_native()
    if native is None:
        raise SystemExit(error)
    kvm = make_kv_cache_manager(num_blocks, block_size)
    state = engine_state(kvm, vocab_size=4096, max_model_len=(num_blocks - 1) * block_size)

    def no_walk(session_id: str, token_ids: Any) -> dict[str, Any]:
        raise AssertionError("an open gate never walks the prefix")

    book = native_book(native, native.GateConfig(), 30.0, state, no_walk, lambda at: None)
    return book, state


def run(pairs: int, modes: list[str], num_blocks: int, block_size: int) -> dict[str, Any]:
    thrash = _thrashers()
    book, state = _book(num_blocks, block_size)
    admit, release, usage = book.admit, book.release, state.usage_answer
    samples: dict[str, dict[str, list[float]]] = {
        m: {"admit": [], "admit_outer": [], "release_outer": [], "usage": [], "noop": []}
        for m in modes
    }
    clock = time.perf_counter_ns
    n = 0
    # Modes take turns in blocks of BLOCK pairs (the VM's drift hits each alike); the first
    # pair of a block runs after another mode's thrash, so it is not recorded. The first
    # WARMUP rounds size every table and are not recorded either.
    for r in range(WARMUP + -(-pairs // (BLOCK - 1))):
        for m in modes:
            s, t = samples[m], thrash[m]
            for j in range(BLOCK):
                n += 1
                t()
                # As vLLM decodes them: new str objects and a new list per call.
                session, ticket = f"loop-{n}", f"ticket-{n:08}"
                tokens = list(range(10, 42))
                started = clock()
                answer = admit(session, tokens, 1, False, ticket, "client-0")
                admit_outer = clock() - started
                t()
                started = clock()
                released = release(answer["lease"], "client-0")
                release_outer = clock() - started
                if not released or answer["reason"] != "open":
                    raise RuntimeError(f"expected an open admit, released: {answer}")
                t()
                u = usage()
                t()
                started = clock()
                book.lease_ttl_sec  # noqa: B018 - the cheapest native call there is
                noop = clock() - started
                if r >= WARMUP and j > 0 and len(s["admit"]) < pairs:
                    s["admit"].append(answer["engine_us"])
                    s["admit_outer"].append(admit_outer / 1e3)
                    s["release_outer"].append(release_outer / 1e3)
                    s["usage"].append(u["engine_us"])
                    s["noop"].append(noop / 1e3)
    out: dict[str, Any] = {"pairs": pairs}
    base = None
    for m in modes:
        p50 = {k: statistics.median(v) for k, v in samples[m].items()}
        # The engine's figure: admit's own timer + release (here from outside the call, which
        # adds the Python call itself: about the noop's time).
        pair = p50["admit"] + p50["release_outer"]
        row = {f"{k}_us_p50": round(v, 2) for k, v in p50.items()}
        row["pair_us_p50"] = round(pair, 2)
        row["pair_over_usage_probe"] = round(pair / p50["usage"], 2)
        if base is None:
            base = pair
        row["pair_over_none"] = round(pair / base, 2) if modes[0] == "none" else None
        out[m] = row
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=200)
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated; 'none' first")
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=32)
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        if m not in MODES:
            p.error(f"unknown mode {m!r}: expected some of {', '.join(MODES)}")
    print(json.dumps(run(args.pairs, modes, args.num_blocks, args.block_size), sort_keys=True))


if __name__ == "__main__":
    main()
