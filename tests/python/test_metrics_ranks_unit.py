"""``metrics_mirror.ranked_text``: several DP ranks' Prometheus texts made one (pure, no
engine): every sample labelled with its rank, each family once, ranks without a gate left out.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families
from session_gate.engine.metrics_mirror import ranked_text

RANK_TEXT = """# HELP session_gate_admitted_total Turns admitted, by reason.
# TYPE session_gate_admitted_total counter
session_gate_admitted_total{reason="open"} OPEN
session_gate_admitted_total{reason="resident_prefix"} 1.0
# HELP session_gate_committed_blocks Blocks committed.
# TYPE session_gate_committed_blocks gauge
session_gate_committed_blocks BLOCKS
"""


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_each_sample_gains_its_rank_and_each_family_is_listed_once():
    rank0 = RANK_TEXT.replace("OPEN", "3.0").replace("BLOCKS", "5.0")
    rank2 = RANK_TEXT.replace("OPEN", "7.0").replace("BLOCKS", "1.0")
    text = ranked_text([rank0, None, rank2])
    assert text is not None
    assert text.count("# TYPE session_gate_admitted_total counter") == 1, text
    got = samples(text)
    assert got[("session_gate_admitted_total", (("rank", "0"), ("reason", "open")))] == 3.0
    assert got[("session_gate_admitted_total", (("rank", "2"), ("reason", "open")))] == 7.0
    assert got[("session_gate_committed_blocks", (("rank", "2"),))] == 1.0
    assert not any(dict(labels).get("rank") == "1" for _, labels in got), "rank 1 had no gate"
    assert len(got) == 6


def test_no_rank_with_a_gate_is_no_text():
    assert ranked_text([None, None]) is None
    assert ranked_text([]) is None
