"""``SessionGate`` reads the probes' host-tier figures: ints pass into the core, ``"unavailable"``
and answers without them (engines that predate the tier) read as no tier, and any other value is
an unusable answer, named, like any other bad field."""

from __future__ import annotations

import pytest
from session_gate import GateConfig, SessionGate
from session_gate.lab.testing import ScriptedProbe, usage_answer

BS = 16


class TierProbe(ScriptedProbe):
    """A scripted probe whose prefix answers carry ``offloaded_tokens``."""

    offloaded: object = "unavailable"

    async def prefix(self, session_id, prompt_ids):
        answer = await super().prefix(session_id, prompt_ids)
        answer["offloaded_tokens"] = self.offloaded
        return answer


def gate_over(probe: ScriptedProbe, **knobs) -> SessionGate:
    # A watermark below any usage: every admit with something committed asks the prefix probe.
    return SessionGate(probe, GateConfig(high_watermark=0.05, wait_poll_sec=0.05, **knobs))


@pytest.mark.parametrize(
    ("tier_usage", "offloaded"),
    [
        # A tier of 6 blocks cannot hold "a" and "b" (8 blocks): the gate does not step aside.
        ({"offload_num_blocks": 6, "offload_used_blocks": 6}, 64),
        ({"offload_num_blocks": "unavailable", "offload_used_blocks": "unavailable"}, None),
        ({}, "unavailable"),
    ],
)
async def test_tier_figures_are_read_or_read_as_no_tier(tier_usage, offloaded):
    probe = TierProbe(0.5, num_blocks=100, block_size=BS, hit_ratio=1.0)
    probe.set_usage_answer({**usage_answer(0.5, 100, BS), **tier_usage})
    probe.offloaded = offloaded
    gate = gate_over(probe)
    async with gate.admit("a", [7] * (4 * BS), max_tokens=0, retain_session=True):
        # Under pressure with "a" committed: "b" is probed, resident, admitted.
        async with gate.admit("b", [8] * (4 * BS), max_tokens=0) as lease:
            assert lease.reason == "resident_prefix"
    s = gate.stats()
    assert s["probes"]["usage"]["failures"] == 0 and s["probes"]["prefix"]["failures"] == 0
    assert s["probes"]["prefix"]["count"] >= 1


async def test_the_gate_steps_aside_while_the_tier_holds_the_committed_working_sets():
    probe = TierProbe(0.5, num_blocks=100, block_size=BS, hit_ratio=0.0)
    probe.set_usage_answer(
        {**usage_answer(0.5, 100, BS), "offload_num_blocks": 8, "offload_used_blocks": 8}
    )
    gate = gate_over(probe)
    async with gate.admit("a", [7] * (4 * BS), max_tokens=0, retain_session=True):
        # Under pressure, nothing resident, but the tier holds "a" and "b" (8 blocks).
        async with gate.admit("b", [8] * (4 * BS), max_tokens=0) as lease:
            assert lease.reason == "open"
    assert gate.stats()["probes"]["prefix"]["count"] == 0


@pytest.mark.parametrize(
    ("where", "value", "message"),
    [
        ("usage", "lots", "usage answer unusable"),
        ("prefix", "plenty", "prefix answer unusable"),
    ],
)
async def test_a_bad_tier_figure_is_an_unusable_answer(where, value, message):
    probe = TierProbe(0.5, num_blocks=100, block_size=BS, hit_ratio=1.0)
    if where == "usage":
        probe.set_usage_answer({**usage_answer(0.5, 100, BS), "offload_num_blocks": value})
    else:
        probe.offloaded = value
    # Engine pressure fails open on an unusable prefix answer (committed pressure would count
    # it a miss and wait), so the turn comes back with the error that named the field.
    gate = gate_over(probe, pressure="engine")
    async with gate.admit("a", [7] * (4 * BS), max_tokens=0, retain_session=True):
        async with gate.admit("b", [8] * (4 * BS), max_tokens=0) as lease:
            assert message in (lease.probe_error or ""), lease.probe_error
    assert gate.stats()["probes"][where]["failures"] >= 1
