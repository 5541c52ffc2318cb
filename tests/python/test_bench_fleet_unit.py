"""The fleet bench's pure parts, without engines: the fleet's ideal hit, the merge of rounds,
the targets, the hash routing of ``none``, the replicas' cores and the CPU-time reading."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from session_gate.lab.bench import fleet
from session_gate.results import ModeResult, TurnRecord


def _result(ideals: list[int]) -> ModeResult:
    """One first turn per session (prompt 1,000 tokens, 512 cached ideally unless 0 given)."""
    records = [
        TurnRecord(f"s{i}", 0, 1000, min(ideal, 400), ideal, 1.0, 0.0, "gate")
        for i, ideal in enumerate(ideals)
    ]
    return ModeResult("gate", "w", 10.0, records)


def test_each_replica_that_served_turns_prefills_the_system_prompt_once():
    two = fleet.fleet_summary(_result([0, 512, 512]), [2, 1])
    assert two["ideal_prefill_tokens"] == 3000 - 512 and two["turns_by_replica"] == [2, 1]
    one = fleet.fleet_summary(_result([0, 512, 512]), [3, 0])
    assert one["ideal_prefill_tokens"] == 3000 - 1024


def _summary(mode: str, makespan: float, hit: float, split: list[int]) -> dict:
    return {
        "mode": mode,
        "makespan_sec": makespan,
        "replica_cpu_sec": makespan * 1.5,
        "hit_rate": hit,
        "ideal_hit_rate": 0.9,
        "recompute_ratio": 1.0,
        "turns_by_replica": split,
        "placements": {"new": 4, "resident": 8} if mode != "none" else {},
        "moves": 0,
        "finished_blocks_evicted_first": int(makespan) if mode != "none" else 0,
    }


def test_rounds_merge_to_medians_and_the_targets_read_them():
    rounds = [
        [_summary("gate", m, 0.88, s), _summary("hash", h, 0.8, [6, 6])]
        for m, h, s in ((10.0, 12.0, [8, 4]), (30.0, 11.0, [6, 6]), (11.0, 13.0, [6, 6]))
    ]
    rows = fleet.merge(rounds, "w")
    gate = next(r for r in rows if r["mode"] == "gate")
    assert gate["makespan_sec"] == 11.0 and gate["turns_by_replica"] == [6, 6]
    assert [r["makespan_sec"] for r in gate["rounds"]] == [10.0, 30.0, 11.0]
    assert gate["finished_blocks_evicted_first"] == 11
    assert [r["finished_blocks_evicted_first"] for r in gate["rounds"]] == [10, 30, 11]
    assert gate["hit_vs_ideal"] == pytest.approx(0.88 / 0.9)
    t = fleet.targets(rows)
    assert t["gate_makespan_over_best_of_sticky_hash"] == pytest.approx(11.0 / 12.0)
    assert t["gate_no_slower"] is True and t["gate_hit_at_least_0_95_ideal"] is True
    slow = fleet.targets([dict(gate, makespan_sec=13.0), *[r for r in rows if r is not gate]])
    assert slow["gate_no_slower"] is False
    alone = fleet.targets([r for r in rows if r["mode"] == "hash"])
    assert alone == dict.fromkeys(alone)  # every figure None without gate
    assert "hash" in fleet.table(rows, 3) and "new 4, resident 8" in fleet.table(rows, 3)


def test_no_gate_hashes_each_session_to_one_replica():
    chosen = [fleet.replica_of(f"s{i}", 2) for i in range(32)]
    assert chosen == [fleet.replica_of(f"s{i}", 2) for i in range(32)]
    assert set(chosen) == {0, 1}


def test_each_replica_gets_cores_of_its_own():
    binds = fleet.cpu_halves(2)
    assert len(binds) == 2
    if len(os.sched_getaffinity(0)) >= 2:
        cores = [set(b.split(",")) for b in binds]
        assert cores[0] and cores[1] and not cores[0] & cores[1]
    else:
        assert binds == ["nobind", "nobind"]


#: A grandchild that burns 0.3 s of CPU, says its pid, then idles (a replica's engine core is a
#: child of its API server).
_BURN = (
    "import os, time\n"
    "end = time.process_time() + 0.3\n"
    "while time.process_time() < end:\n"
    "    pass\n"
    "print(os.getpid(), flush=True)\n"
    "time.sleep(60)\n"
)


def test_cpu_seconds_of_a_process_tree_grow_with_work():
    # A tree of its own, not pytest's: pytest's other children (an earlier test's engine shutting
    # down) may exit between two readings and take their CPU seconds with them.
    parent = subprocess.Popen(
        [sys.executable, "-c", f"import subprocess, sys, time\n"
         f"subprocess.Popen([sys.executable, '-c', {_BURN!r}])\n"
         "time.sleep(60)\n"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        burner = int(parent.stdout.readline())
        burned = fleet.tree_cpu_sec(burner)
        assert burned >= 0.25, burned
        # The parent only slept after starting it: its tree's seconds are the grandchild's.
        assert fleet.tree_cpu_sec(parent.pid) >= burned
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()
    assert fleet.tree_cpu_sec(2**22 + 12345) == 0.0  # no such process


def test_bad_arguments_are_named(capsys):
    for argv, said in (
        (["--modes", "gate,nope"], "unknown mode 'nope'"),
        (["--modes", "gate,gate"], "name each mode once"),
        (["--reps", "0"], "--reps 0"),
        (["--turns", "0"], "--turns 0"),
    ):
        with pytest.raises(SystemExit):
            fleet.parse_args(argv)
        assert said in capsys.readouterr().err
