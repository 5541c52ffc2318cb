"""A twin profile records the machine it was fitted on, and every comparison of the twin with
the real engine checks it first: the identity comparison, the ``[machine]`` table calibrate
writes (read back by the Rust parser), the shipped ``cpu-tiny`` (which does not know its
machine), and the refusal, which names what differs and how to calibrate, before any engine
starts. No engine runs here."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from session_gate import _native
from session_gate.lab.sim import calibrate, fidelity
from session_gate.lab.sim import machine as machines

DOCS = Path(__file__).resolve().parents[2] / "docs" / "fidelity"
HERE = {
    "arch": "x86_64",
    "cpu_model": "Intel(R) Xeon(R) Processor",
    "cpus": 2,
    "cpu_flags": ["amx_bf16", "avx2", "avx512f"],
    "vllm_version": "0.32.0",
}


def fitted(**changes):
    return {"known": True, **HERE, **changes}


def test_the_same_hardware_has_no_differences_whatever_the_flag_order():
    assert machines.differences(fitted(cpu_flags=["avx512f", "avx2", "amx_bf16"]), HERE) == []


def test_each_identity_field_that_differs_is_named():
    diffs = machines.differences(fitted(cpu_model="AMD EPYC 9654", cpus=8), HERE)
    assert diffs == [
        "cpu_model: 'AMD EPYC 9654' there, 'Intel(R) Xeon(R) Processor' here",
        "cpus: 8 there, 2 here",
    ]
    (flags,) = machines.differences(fitted(cpu_flags=["avx2", "avx512f"]), HERE)
    assert flags == "cpu_flags: none there only, amx_bf16 here only"
    (version,) = machines.differences(fitted(vllm_version="0.31.0"), HERE)
    assert version.startswith("vllm_version")


def test_an_unknown_machine_is_other_hardware():
    assert machines.differences(None, HERE) == [
        "the profile does not say which machine it was fitted on"
    ]
    (why,) = machines.differences({"known": False, "note": "not recorded"}, HERE)
    assert "does not know" in why and "not recorded" in why
    shipped = machines.profile_machine(_native.sim_profile_text("cpu-tiny"))
    assert shipped["known"] is False
    assert machines.differences(shipped, machines.this_machine())


def test_cpuinfo_gives_the_model_and_the_isa_flags_of_x86_and_arm(tmp_path):
    x86 = tmp_path / "x86"
    x86.write_text(
        "processor\t: 0\nmodel name\t: Some Xeon\nflags\t\t: fpu sse avx2 amx_bf16 aes\n\n"
        "processor\t: 1\nmodel name\t: Some Xeon\nflags\t\t: fpu sse avx2 amx_bf16 aes\n"
    )
    model, flags = machines._cpuinfo(str(x86))
    assert model == "Some Xeon" and "aes" in flags
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd sve bf16\nCPU part\t: 0xd40\n")
    assert machines._cpuinfo(str(arm)) == (None, ["fp", "asimd", "sve", "bf16"])
    here = machines.this_machine()
    assert set(here) == set(machines.IDENTITY)
    assert set(here["cpu_flags"]) <= set(machines.ISA_FLAGS) and here["cpus"] >= 1


def write_profile(path: Path, identity: dict | None) -> Path:
    """A cpu-tiny-shaped profile calibrate would write, fitted on ``identity``."""
    coef = np.array([0.006, 0.0002, 0.00005, 2.7e-08, 1.6e-07])
    text = calibrate.profile_toml(coef, "test", "cpu-tiny", dict(calibrate.TINY_ENGINE), identity)
    path.write_text(text)
    return path


def test_calibrate_writes_the_machine_and_the_twin_reads_the_profile(tmp_path):
    here = machines.this_machine()
    path = write_profile(tmp_path / "cpu-tiny.toml", here)
    text = path.read_text()
    table = machines.profile_machine(text)
    assert table["known"] is True and "fitted" in table
    assert machines.differences(table, here) == []
    # The Rust parser accepts the table (it refuses unknown fields).
    assert _native.sim_profile_step_times(str(path), text, [[(128, 0, 128, 1)]])[0] > 0
    unknown = machines.profile_machine(write_profile(tmp_path / "u.toml", None).read_text())
    assert unknown["known"] is False


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SESSION_GATE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "profiles"


def test_the_shipped_profile_is_refused_before_any_engine_starts_with_how_to_calibrate(cache):
    with pytest.raises(fidelity.OtherHardware) as exc:
        fidelity.main(["--workload", "default", "--modes", "none,gate"])
    message = str(exc.value)
    assert "profile cpu-tiny was fitted on other hardware" in message
    assert "does not know which machine" in message
    assert "make sim-fidelity" in message
    assert "python -m session_gate.lab.sim.calibrate --machine-local" in message
    assert str(cache / "cpu-tiny.toml") in message
    assert exc.value.code != 0


def test_a_machine_local_fit_of_this_machine_is_used_and_one_of_another_is_not(cache):
    here = machines.this_machine()
    cache.mkdir(parents=True)
    local = write_profile(cache / "cpu-tiny.toml", {**here, "cpu_model": "another CPU"})
    with pytest.raises(fidelity.OtherHardware, match="cpu_model: 'another CPU' there"):
        fidelity.resolve_profile("cpu-tiny", here)
    write_profile(local, here)
    assert fidelity.resolve_profile("cpu-tiny", here) == (str(local), [])
    # A TOML given by path is judged as it is.
    assert fidelity.resolve_profile(str(local), here) == (str(local), [])


def test_refit_fits_the_builtin_profile_here_even_when_a_fit_exists(cache, monkeypatch):
    """``--refit`` (make sim-fidelity) always fits first: a VM's speed drifts over hours.
    The calibration itself is stood in for (it starts an engine); what is checked is that it
    is asked for, for the right profile, and that its fit is the one compared."""
    from session_gate.lab.sim import calibrate as calibration

    here = machines.this_machine()
    cache.mkdir(parents=True)
    local = write_profile(cache / "cpu-tiny.toml", here)
    asked = []
    monkeypatch.setattr(calibration, "main", lambda argv: asked.append(argv))
    assert fidelity.resolve_profile("cpu-tiny", here) == (str(local), [])
    assert asked == []
    assert fidelity.resolve_profile("cpu-tiny", here, refit=True) == (str(local), [])
    assert asked == [["--machine-local", "--name", "cpu-tiny"]]
    with pytest.raises(SystemExit, match="--refit fits a built-in profile"):
        fidelity.resolve_profile(str(local), here, refit=True)
    with pytest.raises(SystemExit):
        fidelity.parse_args(["--refit", "--real-json", str(DOCS / "real-default-none.json")])


def test_real_results_from_another_machine_need_a_profile_fitted_there(tmp_path, cache, capsys):
    here = machines.this_machine()
    profile = write_profile(tmp_path / "mine.toml", here)
    real = json.loads((DOCS / "real-default-none.json").read_text())
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps({**real, "machine_identity": {**here, "cpus": 64}}))
    argv = ["--workload", "default", "--modes", "none", "--out", str(tmp_path / "f.json")]
    with pytest.raises(fidelity.OtherHardware, match=r"cpus: \d+ there, 64 here"):
        fidelity.main([*argv, "--profile", str(profile), "--real-json", str(elsewhere)])
    # --other-hardware compares anyway, and the result says so.
    fidelity.main([*argv, "--real-json", str(DOCS / "real-default-none.json"), "--other-hardware"])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["other_hardware"] and last["profile"] == "cpu-tiny"


def test_the_matrix_says_its_cpu_tiny_rows_are_projections_from_other_hardware():
    from session_gate.lab.bench.matrix import cpu_tiny_note

    note = cpu_tiny_note()
    assert "fitted on other hardware" in note and "make sim-fidelity" in note


def test_a_poor_fit_is_reported_and_a_good_one_is_not():
    assert calibrate.fit_warning(0.207, -0.0) is None
    assert "poor fit" in calibrate.fit_warning(1.498, 0.107)
    assert "poor fit" in calibrate.fit_warning(0.2, -0.08)
