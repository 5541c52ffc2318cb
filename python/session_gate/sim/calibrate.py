"""``python -m session_gate.sim.calibrate``: fit the twin's ``cpu-tiny`` cost profile to this
machine's CPU engine.

It times real engine steps of the bench's tiny CPU engine (1,024 blocks x 32 tokens,
``max_num_seqs`` 16, ``max_num_batched_tokens`` 8,192) across prefill sizes, cached prefixes,
decode batch sizes and contexts, and mixed steps, then the bench's own ``default`` workload
replayed turn by turn (``--replay-turns``: steps with many requests, a shared system prompt and
a full cache, which the synthetic scenarios alone under-predict by 1.4-1.9x) — all through
``session_gate.engine.step_timing``; fits the
profile's coefficients by non-negative least squares (seconds), using the twin's own
regressors (``_native.sim_step_features``, the Rust ``StepWork``); prints the fit error; and
writes the profile TOML, which it then reads back through the Rust parser to check it.

The last line printed is JSON: the coefficients and the fit error.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from session_gate import _native

#: Fitted coefficients, in the order of ``StepWork::features`` (weights_sec is 0 on CPU).
NAMES = ("step_sec", "per_seq_sec", "per_token_sec", "prefill_attn_sec", "decode_ctx_sec")
MEANING = {
    "step_sec": "fixed cost per engine step",
    "per_seq_sec": "cost per scheduled request",
    "per_token_sec": "cost per scheduled token",
    "prefill_attn_sec": "cost per prefill token pair, sum of c*(p + c/2)",
    "decode_ctx_sec": "cost per decode context token",
}


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with x >= 0: solve, drop the most negative coefficient, repeat."""
    active = list(range(a.shape[1]))
    x = np.zeros(a.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        if (sol >= 0).all():
            x[:] = 0.0
            x[active] = sol
            return x
        active.pop(int(np.argmin(sol)))
    return x


def fit(features: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """Coefficients minimising the squared error of every step in seconds (plain least squares,
    non-negative). Not the relative error: the twin's outputs (makespan, latency) are sums of
    step times, and with a fixed per-step term plain least squares makes the modelled total of
    the fitted steps equal the measured total, however noisy single steps are."""
    return nnls(features, seconds)


def profile_toml(coef: np.ndarray, note: str, shape: dict[str, int]) -> str:
    lines = [
        "# Twin profile: the bench's tiny CPU engine (2-layer Llama, dummy weights, vLLM CPU).",
        f"# Fitted by `python -m session_gate.sim.calibrate` ({note}).",
        "# Re-fit on your machine with `make sim-calibrate`.",
        'name = "cpu-tiny"',
        "description = \"tiny 2-layer Llama (dummy weights) on vLLM's CPU backend, fitted on "
        f'{platform.machine()} ({_cpus()} CPUs)"',
        "",
        "[replica]",
        "# KV bytes per token: 2 layers x 4 KV heads x 64 head dim x 2 (K,V) x 2 bytes.",
        "kv_bytes_per_token = 2048",
        f"num_blocks = {shape['num_blocks']}",
        f"block_size = {shape['block_size']}",
        f"max_num_seqs = {shape['max_num_seqs']}",
        f"max_num_batched_tokens = {shape['max_num_batched_tokens']}",
        "# vLLM's CPU platform turns async scheduling off (vllm/platforms/cpu.py).",
        "async_scheduling = false",
        'source = "the bench\'s engine shape (session_gate.bench.workloads.EngineShape)"',
        "",
        "[cost]",
    ]
    values = dict(zip(NAMES, coef, strict=True))
    for name in ("step_sec", "per_seq_sec", "per_token_sec"):
        lines.append(_coef_line(name, values[name], note))
    lines.append(
        'weights_sec = { value = 0.0, source = "not separable on CPU: a weight-read floor is '
        'folded into step_sec by the fit" }'
    )
    for name in ("prefill_attn_sec", "decode_ctx_sec"):
        lines.append(_coef_line(name, values[name], note))
    return "\n".join(lines) + "\n"


def _coef_line(name: str, value: float, note: str) -> str:
    return f'{name} = {{ value = {value:.6e}, source = "fitted: {MEANING[name]}; {note}" }}'


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


@dataclass
class _Step:
    scenario: str
    seconds: float
    entries: list[tuple[int, int, int, int]]


def _replay(turns: int) -> Any:
    """The bench's ``default`` workload (its sessions, prompts and outputs) for ``turns`` turns,
    as steps to time: the steps the twin has to predict for the bench look like these."""
    from session_gate.bench.workloads import WORKLOADS
    from session_gate.engine.step_timing import Replay

    workload = WORKLOADS["default"](0)
    sessions = [
        (s.system_tokens, s.task_tokens, [(t.append, t.output) for t in s.turns[:turns]])
        for s in workload.sessions
    ]
    return Replay(f"replay-default-{turns}", sessions)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m session_gate.sim.calibrate", description=__doc__)
    p.add_argument("--out", default="cpu-tiny.toml", help="where to write the profile TOML")
    p.add_argument("--repeats", type=int, default=2, help="runs of every scenario")
    p.add_argument("--quick", action="store_true", help="a few scenarios only (smoke test)")
    p.add_argument("--max-prompt", type=int, default=8000)
    p.add_argument(
        "--replay-turns",
        type=int,
        default=6,
        help="also time the bench's default workload replayed for this many turns (0: none)",
    )
    p.add_argument("--steps-json", help="also write every timed step here (for --from-steps)")
    p.add_argument("--from-steps", help="fit steps saved by --steps-json; starts no engine")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    shape = dict(num_blocks=1024, block_size=32, max_num_seqs=16, max_num_batched_tokens=8192)
    if args.from_steps:
        with open(args.from_steps) as f:
            steps = [
                _Step(d["scenario"], d["seconds"], [tuple(e) for e in d["entries"]])
                for d in json.load(f)
            ]
    else:
        from session_gate.engine.step_timing import calibration_scenarios, time_steps

        scenarios = calibration_scenarios(args.max_prompt)
        if args.quick:
            keep = {"prefill-128", "prefill-2048", "cached-1024+512", "decode-4x64"}
            scenarios = [s for s in scenarios if s.name in keep]
        replays = [] if args.quick or not args.replay_turns else [_replay(args.replay_turns)]
        steps = time_steps(
            scenarios,
            replays=replays,
            repeats=args.repeats,
            **shape,
            progress=lambda name: print(f"  timing {name}", file=sys.stderr, flush=True),
        )
    if args.steps_json:
        with open(args.steps_json, "w") as f:
            json.dump([vars(s) for s in steps], f)
    feats = np.array([_native.sim_step_features(s.entries) for s in steps])
    secs = np.array([s.seconds for s in steps])
    coef = fit(feats, secs)
    pred = feats @ coef
    rel = np.abs(pred - secs) / secs
    by_scenario: dict[str, list[float]] = {}
    for s, p in zip(steps, pred, strict=True):
        acc = by_scenario.setdefault(s.scenario, [0.0, 0.0])
        acc[0] += s.seconds
        acc[1] += float(p)
    scen_err = {k: (v[1] - v[0]) / v[0] for k, v in by_scenario.items()}
    total_err = (pred.sum() - secs.sum()) / secs.sum()

    today = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    note = (
        f"{len(steps)} steps, {today}, per-step mean abs error {rel.mean():.1%}, "
        f"total-time error {total_err:+.1%}"
    )
    text = profile_toml(coef, note, shape)
    # Read it back through the Rust parser: the same predictions, or the file is wrong.
    check = np.array(_native.sim_profile_step_times(args.out, text, [s.entries for s in steps]))
    assert np.allclose(check, pred, rtol=1e-4, atol=1e-9), "profile does not reproduce the fit"
    with open(args.out, "w") as f:
        f.write(text)

    print(f"{'scenario':<22} {'steps':>5} {'measured s':>11} {'model s':>9} {'error':>7}")
    for name, (meas, model) in by_scenario.items():
        count = sum(1 for s in steps if s.scenario == name)
        print(f"{name:<22} {count:>5} {meas:>11.4f} {model:>9.4f} {scen_err[name]:>+7.1%}")
    print(
        f"fit over {len(steps)} steps: per-step mean abs error {rel.mean():.1%} "
        f"(median {np.median(rel):.1%}, p90 {np.quantile(rel, 0.9):.1%}); "
        f"total time {secs.sum():.3f} s measured vs {pred.sum():.3f} s model ({total_err:+.1%}); "
        f"worst scenario {max(scen_err.values(), key=abs):+.1%}"
    )
    print(f"wrote {args.out}")
    result = {
        "profile": "cpu-tiny",
        "out": args.out,
        "steps": len(steps),
        "coefficients": dict(zip(NAMES, map(float, coef), strict=True)),
        "step_mean_abs_error": float(rel.mean()),
        "step_median_abs_error": float(np.median(rel)),
        "total_time_error": float(total_err),
        "worst_scenario_error": float(max(scen_err.values(), key=abs)),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
