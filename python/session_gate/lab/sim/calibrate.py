"""``python -m session_gate.lab.sim.calibrate``: fit a twin cost profile to a real engine — by
default the bench's tiny CPU engine (``cpu-tiny``), or your own model and engine shape on your
own hardware (``--model``, ``--block-size``, ``--num-gpu-blocks`` or
``--gpu-memory-utilization``, ``--max-num-seqs``, ``--max-num-batched-tokens``,
``--max-model-len``, ``--tensor-parallel-size``, ``--dtype``, ...: passed to the vLLM engine it
starts, as ``vllm serve`` takes them).

It times real engine steps (by default of the bench's tiny CPU engine: 1,024 blocks x 32
tokens, ``max_num_seqs`` 16, ``max_num_batched_tokens`` 8,192) across prefill sizes, cached
prefixes, decode batch sizes and contexts, and mixed steps, then the bench's own ``default``
workload replayed turn by turn (``--replay-turns``: steps with many requests, a shared system
prompt and a full cache, which the synthetic scenarios alone under-predict by 1.4-1.9x) — all
through ``session_gate.lab.engine.step_timing``; fits the profile's coefficients by non-negative
least squares (seconds), using the twin's own regressors (``_native.sim_step_features``, the
Rust ``StepWork``); prints the fit error; and writes the profile TOML, which it then reads back
through the Rust parser to check it. The
profile's ``[replica]`` is the shape the engine really got (vLLM sizes the KV cache from
``gpu_memory_utilization`` unless ``--num-gpu-blocks`` sets it) and its ``[engine]`` table
records the model, dtype, tensor parallelism, device and vLLM version, and its ``[machine]``
table the machine the steps were timed on (``session_gate.lab.sim.machine``: CPU model, CPUs,
instruction-set flags, vLLM version), which every comparison of the twin with a real engine
checks first. ``--machine-local`` writes the profile outside the checkout, where those
comparisons look for this machine's fit (``~/.cache/session-gate/profiles/<name>.toml``).

The last line printed is JSON: the coefficients and the fit error.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from session_gate import _native
from session_gate.lab.sim import machine as machines

#: Fitted coefficients, in the order of ``StepWork::features`` (weights_sec is not fitted).
NAMES = ("step_sec", "per_seq_sec", "per_token_sec", "prefill_attn_sec", "decode_ctx_sec")
MEANING = {
    "step_sec": "fixed cost per engine step",
    "per_seq_sec": "cost per scheduled request",
    "per_token_sec": "cost per scheduled token",
    "prefill_attn_sec": "cost per prefill token pair, sum of c*(p + c/2)",
    "decode_ctx_sec": "cost per decode context token",
}

#: The bench's tiny CPU engine, as ``make sim-calibrate`` times it (and steps saved by an older
#: ``--steps-json``, a bare list of steps, were timed on).
TINY_ENGINE = {
    "num_blocks": 1024,
    "block_size": 32,
    "max_num_seqs": 16,
    "max_num_batched_tokens": 8192,
    "kv_bytes_per_token": 2048,
    "async_scheduling": False,
}

#: ``[replica]`` keys of the profile that say the engine's shape.
SHAPE_KEYS = ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens")

#: ``[engine]`` keys of the profile, from :func:`session_gate.lab.engine.step_timing.engine_record`.
ENGINE_KEYS = (
    "model",
    "load_format",
    "dtype",
    "tensor_parallel_size",
    "max_model_len",
    "gpu_memory_utilization",
    "num_gpu_blocks_override",
    "enforce_eager",
    "device",
    "vllm_version",
    "command",
)


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
    the fitted steps equal the measured total, however noisy single steps are.

    The price is the per-step error of short steps (2026-12-03, the 711 steps of ``cpu-tiny``):
    20.7% mean with this fit, 10.5% with the same five terms fitted to relative errors (total
    -0.1%) — so the form is not missing a term (a separate cost per prefilling request gives
    18.9%, a decode-only-step term nothing). But the relative fit under-predicts the long steps
    that set the bench's makespans (prefills -5 to -15%, the replayed ``default`` +3.5%) and
    breaks ``make sim-fidelity``'s targets (``default`` cap8 prefill tokens +16%, order of
    modes), as does the prefill term (``mixed`` cap8 hit rate +0.032)."""
    return nnls(features, seconds)


#: A fit worse than this is reported as poor: a least-squares fit in seconds with a fixed
#: per-step term puts the total within a few percent, and the shipped fit's per-step mean
#: error was 20.7%; on 2026-12-06 a fit timed while other engines loaded the same 2 CPUs
#: reached 149.8% per step and +10.7% in total (NNLS dropped the fixed terms).
POOR_TOTAL_ERROR = 0.05
POOR_STEP_ERROR = 0.5


def fit_warning(step_mean_abs_error: float, total_time_error: float) -> str | None:
    """A warning when the fit is poor (its steps were likely timed under other load), else
    None."""
    if abs(total_time_error) <= POOR_TOTAL_ERROR and step_mean_abs_error <= POOR_STEP_ERROR:
        return None
    return (
        f"calibrate: WARNING: a poor fit (per-step mean abs error {step_mean_abs_error:.1%}, "
        f"total-time error {total_time_error:+.1%}): the steps were probably timed while other "
        "work loaded the machine; time them again on a quiet machine (--repeats 3) before "
        "trusting the twin's step times"
    )


def profile_toml(
    coef: np.ndarray,
    note: str,
    name: str,
    engine: dict[str, Any],
    machine: dict[str, Any] | None = None,
) -> str:
    """The profile's text. ``engine`` is the engine's record (its shape and, for a calibrated
    engine, the ``[engine]`` fields); without a model in it, the bench's tiny engine.
    ``machine`` is the identity of the machine the steps were timed on
    (``machine.this_machine()``; None: unknown, so the profile counts as other hardware)."""
    tiny = "model" not in engine
    if tiny:
        header = [
            "# Twin profile: the bench's tiny CPU engine (2-layer Llama, dummy weights, vLLM CPU).",
            f"# Fitted by `python -m session_gate.lab.sim.calibrate` ({note}).",
            "# Re-fit on your machine with `make sim-calibrate`.",
        ]
        description = (
            f"tiny 2-layer Llama (dummy weights) on vLLM's CPU backend, fitted on "
            f"{platform.machine()} ({_cpus()} CPUs)"
        )
        source = (
            "the bench's engine shape (session_gate.workloads.EngineShape)"
            if all(engine[k] == v for k, v in TINY_ENGINE.items())
            else "the tiny engine's shape as calibrate's flags set it"
        )
        kv_note = "# KV bytes per token: 2 layers x 4 KV heads x 64 head dim x 2 (K,V) x 2 bytes."
    else:
        header = [
            f"# Twin profile: {engine['model']} on {engine['device']}, "
            f"vLLM {engine['vllm_version']}.",
            f"# Fitted by `python -m session_gate.lab.sim.calibrate` ({note}).",
            "# Re-fit with the command in [engine] (the same flags as your `vllm serve`).",
        ]
        tp = engine["tensor_parallel_size"]
        description = (
            f"{engine['model']} ({engine['dtype']}, TP {tp}) on {engine['device']}, "
            f"vLLM {engine['vllm_version']}; fitted from timed engine steps"
        )
        source = (
            "the calibrated engine's own KV cache config and scheduler limits "
            "(python -m session_gate.lab.sim.calibrate)"
        )
        kv_note = "# KV bytes per token: the engine's KV cache spec, all tensor-parallel ranks."
    lines = [
        *header,
        f"name = {_toml_str(name)}",
        f"description = {_toml_str(description)}",
        "",
        "[replica]",
        kv_note,
        f"kv_bytes_per_token = {engine['kv_bytes_per_token']}",
        "# KV blocks including vLLM's null block (num_gpu_blocks), as the engine allocated them.",
        f"num_blocks = {engine['num_blocks']}",
        f"block_size = {engine['block_size']}",
        f"max_num_seqs = {engine['max_num_seqs']}",
        f"max_num_batched_tokens = {engine['max_num_batched_tokens']}",
        "# What a served engine on this platform does: vLLM's CPU platform turns async",
        "# scheduling off (vllm/platforms/cpu.py); on a GPU it is on by default (the steps are",
        "# timed with it off either way, one step per call).",
        f"async_scheduling = {'true' if engine['async_scheduling'] else 'false'}",
        f"source = {_toml_str(source)}",
        "",
    ]
    if not tiny:
        lines.append("[engine]")
        for key in ENGINE_KEYS:
            value = engine.get(key)
            if value is None:
                continue
            if isinstance(value, bool):
                lines.append(f"{key} = {'true' if value else 'false'}")
            elif isinstance(value, int | float):
                lines.append(f"{key} = {value}")
            else:
                lines.append(f"{key} = {_toml_str(str(value))}")
        lines.append("")
    lines += [*machines.machine_table(machine), ""]
    lines.append("[cost]")
    values = dict(zip(NAMES, coef, strict=True))
    for key in ("step_sec", "per_seq_sec", "per_token_sec"):
        lines.append(_coef_line(key, values[key], note))
    lines.append(
        'weights_sec = { value = 0.0, source = "not fitted: a weight-read floor is folded into '
        'step_sec by the fit" }'
    )
    for key in ("prefill_attn_sec", "decode_ctx_sec"):
        lines.append(_coef_line(key, values[key], note))
    return "\n".join(lines) + "\n"


def _toml_str(text: str) -> str:
    """A TOML basic string (JSON's escaping is valid TOML for these)."""
    return json.dumps(text, ensure_ascii=False)


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
    from session_gate.lab.engine.step_timing import Replay
    from session_gate.workloads import WORKLOADS

    workload = WORKLOADS["default"](0)
    sessions = [
        (s.system_tokens, s.task_tokens, [(t.append, t.output) for t in s.turns[:turns]])
        for s in workload.sessions
    ]
    return Replay(f"replay-default-{turns}", sessions)


def _int_flag(flag: str, low: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes a whole number, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{flag} must be at least {low}, got {value}")
        return value

    return parse


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(
            f"--gpu-memory-utilization is the fraction of GPU memory vLLM may use, in (0, 1]; "
            f"got {text!r}"
        )
    return value


def _model(text: str) -> str:
    """A model directory with a ``config.json``, or a Hugging Face id ``owner/name``."""
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise argparse.ArgumentTypeError(f"--model {text}: the directory has no config.json")
        return str(path)
    parts = text.split("/")
    if path.exists() or text.startswith((".", "/", "~")) or len(parts) != 2 or not all(parts):
        raise argparse.ArgumentTypeError(
            f"--model {text}: neither a model directory nor a Hugging Face id (owner/name)"
        )
    return text


#: Engine flags: (flag, EngineSpec field, argparse keywords).
ENGINE_FLAGS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    (
        "--model",
        "model",
        dict(
            type=_model,
            help="a model directory or Hugging Face id (default: the bench's tiny model)",
        ),
    ),
    (
        "--load-format",
        "load_format",
        dict(
            help="vLLM's --load-format (auto, safetensors, ...; vLLM checks it); dummy: random "
            "weights of the model's shape, enough for timing (no weights downloaded)",
        ),
    ),
    ("--dtype", "dtype", dict(choices=("auto", "bfloat16", "float16", "half", "float32", "float"))),
    (
        "--block-size",
        "block_size",
        dict(type=_int_flag("--block-size", 1), help="tokens per KV block"),
    ),
    (
        "--num-gpu-blocks",
        "num_gpu_blocks",
        dict(
            type=_int_flag("--num-gpu-blocks", 2),
            help="KV blocks including the null block (vLLM's num_gpu_blocks_override); "
            "default: sized by --gpu-memory-utilization (the tiny engine: 1024)",
        ),
    ),
    ("--gpu-memory-utilization", "gpu_memory_utilization", dict(type=_fraction)),
    ("--max-num-seqs", "max_num_seqs", dict(type=_int_flag("--max-num-seqs", 1))),
    (
        "--max-num-batched-tokens",
        "max_num_batched_tokens",
        dict(type=_int_flag("--max-num-batched-tokens", 1)),
    ),
    ("--max-model-len", "max_model_len", dict(type=_int_flag("--max-model-len", 64))),
    (
        "--tensor-parallel-size",
        "tensor_parallel_size",
        dict(type=_int_flag("--tensor-parallel-size", 1)),
    ),
    (
        "--enforce-eager",
        "enforce_eager",
        dict(
            action="store_true",
            default=None,
            help="CUDA graphs off (as `vllm serve --enforce-eager`); the tiny engine always "
            "runs eager",
        ),
    ),
    ("--trust-remote-code", "trust_remote_code", dict(action="store_true")),
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m session_gate.lab.sim.calibrate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", default="cpu-tiny.toml", help="where to write the profile TOML")
    p.add_argument(
        "--machine-local",
        action="store_true",
        help="write the profile where comparisons with the real engine look for this machine's "
        "fit, outside the checkout: $SESSION_GATE_CACHE or ~/.cache/session-gate, "
        "profiles/<name>.toml (replaces --out)",
    )
    p.add_argument(
        "--name",
        help="the profile's name (default: cpu-tiny for the tiny engine, else --out's stem)",
    )
    p.add_argument(
        "--repeats", type=_int_flag("--repeats", 1), default=2, help="runs of every scenario"
    )
    p.add_argument("--quick", action="store_true", help="a few scenarios only (smoke test)")
    p.add_argument(
        "--max-prompt",
        type=_int_flag("--max-prompt", 32),
        help="the longest prefill timed (default 8000; scenarios longer than the engine's "
        "max_model_len are left out)",
    )
    p.add_argument(
        "--replay-turns",
        type=_int_flag("--replay-turns", 0),
        default=6,
        help="also time the bench's default workload replayed for this many turns (0: none)",
    )
    p.add_argument("--steps-json", help="also write every timed step here (for --from-steps)")
    p.add_argument("--from-steps", help="fit steps saved by --steps-json; starts no engine")
    engine = p.add_argument_group(
        "engine (your model and engine shape, as `vllm serve` takes them; default: the bench's "
        "tiny CPU engine)"
    )
    for flag, dest, kwargs in ENGINE_FLAGS:
        engine.add_argument(flag, dest=dest, **kwargs)
    args = p.parse_args(argv)
    given = [f for f, dest, _ in ENGINE_FLAGS if getattr(args, dest) not in (None, False)]
    if args.from_steps and given:
        p.error(
            f"{', '.join(given)}: --from-steps fits steps already timed (the engine they ran on "
            "is in the file); engine flags only apply when calibrate starts an engine"
        )
    seqs, batched = args.max_num_seqs, args.max_num_batched_tokens
    if seqs is not None and batched is not None and batched < seqs:
        p.error(
            f"--max-num-batched-tokens ({batched}) must be at least --max-num-seqs ({seqs}): "
            "every running request schedules at least one token a step"
        )
    if None not in (args.max_model_len, args.max_prompt) and args.max_prompt >= args.max_model_len:
        p.error(
            f"--max-prompt ({args.max_prompt}) must be below --max-model-len "
            f"({args.max_model_len}): the prompt and its outputs have to fit"
        )
    if args.machine_local and args.model is not None and not args.name:
        p.error("--machine-local with --model: name the profile (--name), its file's name")
    if args.model is None and args.load_format not in (None, "dummy"):
        p.error(f"--load-format {args.load_format}: the tiny model has no weights (give --model)")
    args.command = "python -m session_gate.lab.sim.calibrate " + shlex.join(
        sys.argv[1:] if argv is None else argv
    )
    return args


def _engine_spec(args: argparse.Namespace) -> Any:
    from session_gate.lab.engine.step_timing import EngineSpec

    return EngineSpec(**{dest: getattr(args, dest) for _, dest, _ in ENGINE_FLAGS})


def _load_steps(path: str) -> tuple[list[_Step], dict[str, Any], dict[str, Any] | None]:
    """Steps saved by ``--steps-json``: ``{"engine": ..., "machine": ..., "steps": [...]}``, or
    a bare list of steps (older files, timed on the tiny engine); the machine is None when the
    file does not say (older files)."""
    with open(path) as f:
        data = json.load(f)
    engine, machine = dict(TINY_ENGINE), None
    if isinstance(data, dict):
        engine, machine, data = data["engine"], data.get("machine"), data["steps"]
    steps = [_Step(d["scenario"], d["seconds"], [tuple(e) for e in d["entries"]]) for d in data]
    return steps, engine, machine


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.from_steps:
        steps, engine, machine = _load_steps(args.from_steps)
    else:
        machine = machines.this_machine()
        from session_gate.lab.engine.step_timing import (
            EngineRefused,
            calibration_scenarios,
            time_steps,
        )

        scenarios = calibration_scenarios(args.max_prompt or 8000)
        if args.quick:
            keep = {"prefill-128", "prefill-2048", "cached-1024+512", "decode-4x64", "decode-8x64"}
            scenarios = [s for s in scenarios if s.name in keep]
        replays = [] if args.quick or not args.replay_turns else [_replay(args.replay_turns)]
        try:
            timing = time_steps(
                scenarios,
                replays=replays,
                repeats=args.repeats,
                engine_spec=_engine_spec(args),
                progress=lambda name: print(f"  timing {name}", file=sys.stderr, flush=True),
            )
        except EngineRefused as exc:
            given = [
                f if getattr(args, dest) is True else f"{f} {getattr(args, dest)}"
                for f, dest, _ in ENGINE_FLAGS
                if getattr(args, dest) not in (None, False)
            ]
            print(
                f"calibrate: vLLM refused the engine ({' '.join(given) or 'the tiny engine'}): "
                f"{exc}",
                file=sys.stderr,
            )
            raise SystemExit(2) from exc
        steps, engine = timing.steps, dict(timing.engine)
        if args.model is None:
            # The tiny engine's profile keeps cpu-tiny's form: its shape, no [engine] table.
            engine = {k: engine[k] for k in TINY_ENGINE}
        else:
            engine["command"] = args.command
        if engine.get("vllm_version"):
            # The engine's own word for its version (the distribution's is the same release).
            machine["vllm_version"] = engine["vllm_version"]
    if not steps:
        raise SystemExit("calibrate: no steps were timed (is --max-model-len too short?)")
    if args.steps_json:
        with open(args.steps_json, "w") as f:
            payload = {"engine": engine, "machine": machine, "steps": [vars(s) for s in steps]}
            json.dump(payload, f)
    name = args.name or ("cpu-tiny" if "model" not in engine else Path(args.out).stem)
    if args.machine_local:
        args.out = str(machines.local_profile(name))
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
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
    text = profile_toml(coef, note, name, engine, machine)
    # Read it back through the Rust parser: the same predictions, or the file is wrong.
    check = np.array(_native.sim_profile_step_times(args.out, text, [s.entries for s in steps]))
    assert np.allclose(check, pred, rtol=1e-4, atol=1e-9), "profile does not reproduce the fit"
    with open(args.out, "w") as f:
        f.write(text)

    print(f"{'scenario':<22} {'steps':>5} {'measured s':>11} {'model s':>9} {'error':>7}")
    for scen, (meas, model) in by_scenario.items():
        count = sum(1 for s in steps if s.scenario == scen)
        print(f"{scen:<22} {count:>5} {meas:>11.4f} {model:>9.4f} {scen_err[scen]:>+7.1%}")
    print(
        f"fit over {len(steps)} steps: per-step mean abs error {rel.mean():.1%} "
        f"(median {np.median(rel):.1%}, p90 {np.quantile(rel, 0.9):.1%}); "
        f"total time {secs.sum():.3f} s measured vs {pred.sum():.3f} s model ({total_err:+.1%}); "
        f"worst scenario {max(scen_err.values(), key=abs):+.1%}"
    )
    shape = {k: engine[k] for k in SHAPE_KEYS}
    print(
        f"engine: {engine.get('model', 'the tiny CPU model')}; "
        + ", ".join(f"{k} {v}" for k, v in shape.items())
    )
    print(f"wrote {args.out}")
    poor = fit_warning(float(rel.mean()), float(total_err))
    if poor:
        print(poor, file=sys.stderr)
    result = {
        "profile": name,
        "out": args.out,
        "replica": shape,
        "engine": {k: engine[k] for k in ENGINE_KEYS if engine.get(k) is not None},
        "machine": machine,
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
