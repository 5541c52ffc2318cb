"""``python -m session_gate.lab.sim.calibrate`` on the real tiny CPU engine (short runs): it times
real steps, fits the cost profile, and writes a TOML that the Rust parser accepts and that
predicts the steps it was fitted on. Then a refit from the saved steps, with no engine, gives
the same coefficients. A user's own model and engine shape (``--model``, ``--block-size``, ...)
reach the engine it starts — its steps keep to the shape's limits — and the profile records
them, and the twin runs on that shape. Bad engine flags are refused naming the flag."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from session_gate import _native
from session_gate.lab.engine.launch import write_tiny_model
from session_gate.lab.sim import calibrate
from session_gate.lab.sim import machine as machines

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "example_trace.jsonl"


def run_calibrate(*args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "session_gate.lab.sim.calibrate", *args],
        capture_output=True,
        text=True,
        timeout=900,
    )
    # The root cause of an engine failure is in a worker's traceback, before vLLM's summary.
    errors = [line for line in proc.stderr.splitlines() if "Error" in line][:20]
    assert proc.returncode == 0, "\n".join(errors) + "\n...\n" + proc.stderr[-3000:]
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
    assert "Fitted by `python -m session_gate.lab.sim.calibrate`" in text
    assert result["replica"] == {
        "num_blocks": 1024,
        "block_size": 32,
        "max_num_seqs": 16,
        "max_num_batched_tokens": 8192,
    }
    assert "[engine]" not in text, "the tiny engine's profile keeps cpu-tiny's form"
    # The machine the steps were timed on: this one, so comparisons here accept the profile.
    here = machines.this_machine()
    assert result["machine"]["vllm_version"] == here["vllm_version"]
    assert machines.differences(machines.profile_machine(text), here) == []
    saved = json.loads(steps.read_text())["steps"]
    entries = [[tuple(e) for e in s["entries"]] for s in saved]
    predicted = _native.sim_profile_step_times(str(out), text, entries)
    assert len(predicted) == len(saved) and all(p > 0 for p in predicted)
    # A 2,048-token prefill step costs more than a 4-sequence decode step.
    big = max(range(len(saved)), key=lambda i: saved[i]["entries"][0][0])
    assert predicted[big] > min(predicted)

    refit = run_calibrate("--from-steps", str(steps), "--out", str(tmp_path / "again.toml"))
    assert refit["coefficients"] == coef
    assert refit["machine"] == result["machine"], "the steps file keeps their machine"
    # Steps saved before the file recorded its engine (a bare list) were the tiny engine's.
    old = tmp_path / "old-steps.json"
    old.write_text(json.dumps(saved))
    refit = run_calibrate("--from-steps", str(old), "--out", str(tmp_path / "old.toml"))
    assert refit["coefficients"] == coef and refit["replica"] == result["replica"]
    # ... and did not record their machine: the profile says so (other hardware).
    assert refit["machine"] is None
    assert machines.profile_machine((tmp_path / "old.toml").read_text())["known"] is False


SHAPE = {"num_blocks": 300, "block_size": 64, "max_num_seqs": 6, "max_num_batched_tokens": 1536}


def test_a_calibration_in_process_leaves_the_next_engine_its_own_process(tmp_path):
    """``sim-fidelity --refit`` calibrates in the process that then runs the real bench. The
    calibration's engine core runs in that process (to time its steps); the setting that puts
    it there must not outlive it, or every bench engine after it ran in-process too (on the
    AMX VM: `none` 20% faster and `gate`'s hit 0.13 lower than the bench alone)."""
    script, out = tmp_path / "calibrate_then_look.py", str(tmp_path / "p.toml")
    script.write_text(
        "import os\n"
        "from session_gate.lab.sim import calibrate\n"
        "if __name__ == '__main__':\n"
        "    os.environ.pop('VLLM_ENABLE_V1_MULTIPROCESSING', None)\n"
        f"    calibrate.main(['--quick', '--repeats', '1', '--out', {out!r}])\n"
        "    print('after:', os.environ.get('VLLM_ENABLE_V1_MULTIPROCESSING'))\n"
    )
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "after: None"


def test_your_own_model_and_shape_reach_the_engine_and_the_profile_and_the_twin_runs_it(
    tmp_path,
):
    """The GPU user's command, on the tiny model here: a model directory, dummy weights and an
    engine shape unlike the bench's (64-token blocks, 300 blocks, 6 sequences, 1,536 tokens a
    step, 4,096-token context)."""
    model = write_tiny_model(str(tmp_path / "model"))
    out, steps = tmp_path / "mine.toml", tmp_path / "steps.json"
    flags = [
        "--model", model, "--load-format", "dummy", "--dtype", "bfloat16",
        "--block-size", "64", "--num-gpu-blocks", "300", "--max-num-seqs", "6",
        "--max-num-batched-tokens", "1536", "--max-model-len", "4096", "--enforce-eager",
        # vLLM's CPU worker fails to start at the GPU default of 0.9 (the tiny engine's 0.1).
        "--gpu-memory-utilization", "0.1",
    ]  # fmt: skip
    result = run_calibrate(
        "--quick", "--repeats", "1", *flags, "--out", str(out), "--steps-json", str(steps)
    )
    assert result["replica"] == SHAPE and result["profile"] == "mine"
    # The engine ran with the shape: no step past its limits, and both limits were reached
    # (the 2,048-token prefill chunked at 1,536 tokens; 8 decodes at most 6 a step).
    timed = json.loads(steps.read_text())["steps"]
    tokens = [sum(e[0] for e in s["entries"]) for s in timed]
    seqs = [len(s["entries"]) for s in timed]
    assert max(tokens) == 1536 and max(seqs) == 6, (max(tokens), max(seqs))

    text = out.read_text()
    for line in [f"{k} = {v}" for k, v in SHAPE.items()] + [
        "kv_bytes_per_token = 2048",  # 2 layers x 4 KV heads x 64 head dim x (K, V) x 2 bytes
        "async_scheduling = false",  # vLLM's CPU platform
        'name = "mine"',
    ]:
        assert f"\n{line}\n" in text, line

    # The twin reads it (`session-gate sim --profile FILE`) and runs a trace on its shape.
    results = tmp_path / "r.json"
    proc = subprocess.run(
        [
            sys.executable, "-m", "session_gate.cli", "sim", "--trace", str(EXAMPLE),
            "--profile", str(out), "--modes", "none,gate", "--out", str(results),
        ],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "engine: twin:mine (SIMULATED)" in proc.stdout
    (summaries,) = json.loads(results.read_text())["workloads"].values()
    for s in summaries:
        assert s["engine"] == "twin:mine" and s["turns"] == 28
        assert s["replica"]["shape"] == SHAPE
        engine = s["replica"]["calibrated_engine"]
        assert engine["model"] == model and engine["load_format"] == "dummy"
        assert engine["dtype"] == "bfloat16" and engine["tensor_parallel_size"] == 1
        assert engine["max_model_len"] == 4096 and engine["num_gpu_blocks_override"] == 300
        assert engine["command"].startswith("python -m session_gate.lab.sim.calibrate --quick")
        assert "--block-size 64" in engine["command"]
        assert engine == result["engine"]


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--block-size", "0"], "--block-size must be at least 1"),
        (["--max-num-seqs", "many"], "--max-num-seqs takes a whole number"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
        (["--model", "/no/such/model"], "--model /no/such/model"),
        (["--model", "Qwen2.5-7B"], "--model Qwen2.5-7B"),
        (["--max-num-seqs", "8", "--max-num-batched-tokens", "4"], "--max-num-batched-tokens"),
        (
            ["--max-model-len", "2048", "--max-prompt", "2048"],
            "--max-prompt (2048) must be below --max-model-len",
        ),
        (["--load-format", "auto"], "--load-format auto"),
        (["--from-steps", "s.json", "--block-size", "64"], "--block-size: --from-steps"),
        (["--dtype", "int3"], "--dtype"),
        (["--model"], "--model"),
    ],
)
def test_bad_engine_flags_are_refused_naming_the_flag(args, named, capsys):
    with pytest.raises(SystemExit) as exc:
        calibrate.parse_args(args)
    assert exc.value.code == 2
    assert named in capsys.readouterr().err


def test_a_model_directory_needs_its_config(tmp_path, capsys):
    with pytest.raises(SystemExit):
        calibrate.parse_args(["--model", str(tmp_path)])
    assert "the directory has no config.json" in capsys.readouterr().err


def test_an_engine_vllm_refuses_is_reported_with_the_flags_and_vllm_s_reason():
    # Longer than the tiny model's max_position_embeddings (65,536): vLLM's own check.
    proc = subprocess.run(
        [sys.executable, "-m", "session_gate.lab.sim.calibrate", "--max-model-len", "100000"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "vLLM refused the engine (--max-model-len 100000)" in proc.stderr
    assert "max_model_len" in proc.stderr.split("vLLM refused the engine")[1]
