"""``python -m session_gate.sim.calibrate`` on the real tiny CPU engine (a short run): it times
real steps, fits the cost profile, and writes a TOML that the Rust parser accepts and that
predicts the steps it was fitted on. Then a refit from the saved steps, with no engine, gives
the same coefficients."""

from __future__ import annotations

import json
import subprocess
import sys

from session_gate import _native


def run_calibrate(*args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "session_gate.sim.calibrate", *args],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_quick_calibration_writes_a_profile_the_twin_reads(tmp_path):
    out = tmp_path / "cpu-tiny.toml"
    steps = tmp_path / "steps.json"
    result = run_calibrate(
        "--quick", "--repeats", "1", "--out", str(out), "--steps-json", str(steps)
    )
    coef = result["coefficients"]
    assert set(coef) == {
        "step_sec",
        "per_seq_sec",
        "per_token_sec",
        "prefill_attn_sec",
        "decode_ctx_sec",
    }
    assert all(v >= 0 for v in coef.values())
    assert coef["step_sec"] + coef["per_token_sec"] > 0, "a step costs something"
    assert result["steps"] > 20
    text = out.read_text()
    assert "Fitted by `python -m session_gate.sim.calibrate`" in text
    saved = json.loads(steps.read_text())
    entries = [[tuple(e) for e in s["entries"]] for s in saved]
    predicted = _native.sim_profile_step_times(str(out), text, entries)
    assert len(predicted) == len(saved) and all(p > 0 for p in predicted)
    # A 2,048-token prefill step costs more than a 4-sequence decode step.
    big = max(range(len(saved)), key=lambda i: saved[i]["entries"][0][0])
    assert predicted[big] > min(predicted)

    refit = run_calibrate("--from-steps", str(steps), "--out", str(tmp_path / "again.toml"))
    assert refit["coefficients"] == coef
