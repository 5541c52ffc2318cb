"""``make bench-abi3``: would the engine half keep its speed under CPython's stable ABI (abi3)?

The usage probe counts free-but-cached blocks by visiting every ``KVCacheBlock`` of vLLM's block
pool inside the engine's busy loop. The native module reads each block's ``ref_cnt`` and
``_block_hash`` straight from the dataclass's slots, at offsets taken from the class's member
descriptors (``PyMemberDescrObject``) and walking the list with ``PyList_GET_ITEM``; neither is
part of the limited API, so an abi3 build must read them as ordinary attributes instead — the
native module's own fallback path, taken when a block's type is not vLLM's exact class.

This measures both paths on the same blocks, in one run: real ``KVCacheBlock`` objects (slot
path) and instances of a trivial subclass with the same fields (attribute path, as abi3 would
run), at the sizes of the CPU test engine and of an H200 serving Qwen2.5-7B. Prints a table, then
one JSON line last.
"""

from __future__ import annotations

import json
import platform
import random

from vllm.v1.core.kv_cache_utils import KVCacheBlock

from session_gate import _native

from .bench_probe import _median_us

REPEATS = 20
#: KV blocks: the bench engine's cache, and one H200 at gpu_memory_utilization 0.9.
SIZES = (1_024, 126_000)


class _AttributeBlock(KVCacheBlock):
    """Same fields; a different exact type, so the native count reads attributes (abi3 path)."""


def _blocks(cls: type, n: int) -> list:
    rng = random.Random(n)
    blocks = []
    for i in range(n):
        block = cls(i)
        roll = rng.random()
        if roll < 0.6:  # free but still caching a prefix: what the count looks for
            block._block_hash = i.to_bytes(32, "little") + b"\0\0\0\0"
        elif roll < 0.8:  # in use by a running request
            block.ref_cnt = 1
        blocks.append(block)
    return blocks


def _count(blocks: list) -> int:
    return _native.count_cached_free_blocks(blocks, {})


def main() -> None:
    rows = []
    for n in SIZES:
        slots = _blocks(KVCacheBlock, n)
        attrs = _blocks(_AttributeBlock, n)
        expected = _count(slots)
        if _count(attrs) != expected:
            raise SystemExit("the two paths disagree: the comparison would be meaningless")
        slot_us = _median_us(lambda b=slots: _count(b), REPEATS)
        attr_us = _median_us(lambda b=attrs: _count(b), REPEATS)
        rows.append(
            {
                "blocks": n,
                "cached_free": expected,
                "slot_us": round(slot_us, 1),
                "attribute_us": round(attr_us, 1),
                "abi3_slowdown": round(attr_us / slot_us, 2),
            }
        )
    print(f"usage-probe block count, median of {REPEATS}, {platform.processor() or 'cpu'}")
    print(f"{'blocks':>8} {'slots (us)':>11} {'attributes/abi3 (us)':>21} {'slowdown':>9}")
    for r in rows:
        print(
            f"{r['blocks']:>8} {r['slot_us']:>11} {r['attribute_us']:>21} {r['abi3_slowdown']:>8}x"
        )
    print(json.dumps({"bench": "abi3", "rows": rows}))


if __name__ == "__main__":
    main()
