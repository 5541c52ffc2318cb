"""``lab.bench.infer_audit``: the audit of the session inference against the truth, on
hand-made inference lists (pure logic; the real engine's lists are audited by the bench)."""

from __future__ import annotations

from session_gate.lab.bench.infer_audit import audit, header_ids, runner_ids


def test_every_kind_of_turn_is_counted():
    parse = runner_ids("sched-infer")
    rows = [
        ["sched-infer-a-0.0-1f2e3d4c", "infer:0", "new"],
        ["sched-infer-a-1.0-aaaaaaaa", "infer:0", "continued"],
        ["sched-infer-b-0.0-bbbbbbbb", "infer:1", "new"],
        ["sched-infer-b-1.0-cccccccc", "infer:2", "new"],  # lost its session
        ["sched-infer-c-0.0-dddddddd", "infer:1", "continued"],  # merged into b's
        ["sched-infer-c-1.0-eeeeeeee", "infer:0", "continued"],  # continued a's
        ["gate-a-0.0-ffffffff", "infer:9", "new"],  # another mode's request
    ]
    out = audit(rows, parse)
    assert out["turns"] == 6
    assert out["first_new"] == 2 and out["first_merged"] == 1
    assert out["continued_own"] == 1 and out["new_instead"] == 1
    assert out["continued_other"] == 1
    assert out["merged_sessions"] == 2
    assert out["in_true_session"] == 3 / 6


def test_header_ids_parse_vllm_serve_request_ids():
    parse = header_ids("run-7")
    assert parse("cmpl-run-7|s-3|4-0-1a2b3c4d") == ("s-3", 4)
    assert parse("cmpl-run-8|s-3|4-0-1a2b3c4d") is None
    assert runner_ids("sched-infer")("sched-infer-s-3-2.1-0a0a0a0a") == ("s-3", 2)
