"""``make wheel``: build the one wheel (plugin, gate, proxy, twin CLI) and say what is in it.

Builds with maturin (release, stripped as pyproject.toml says) for the given interpreter, lets
maturin pick the lowest manylinux tag the extension's symbols allow and audit it (``--auditwheel
check``: a wheel that would need a library from the build machine fails here, not on the GPU
node), then prints the wheel's name, size, tags, entry points, requirements and every file with
its size. Also checks
what the issue promises: a manylinux tag, both vLLM plugin entry points, the ``session-gate``
console script, no requirement outside the ``test`` extra and no lab code (benchmarks, soak
runs, demos, test fixtures: ``session_gate/lab/`` stays in the checkout). Prints the wheel's
path last.

    python scripts/wheel.py [--out dist] [--python /path/to/python]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

ENTRY_POINTS = {
    "vllm.general_plugins": "session_gate = session_gate.engine.plugin:register",
    "vllm.endpoint_plugins": "session_gate = session_gate.engine.http_routes:plugin",
    "console_scripts": "session-gate = session_gate.cli:main",
}
#: Python files that belong to the lab, not the product: benchmarks, soak runs, demos, fixtures.
LAB_FILE = re.compile(
    r"session_gate/(lab/.*|(.*/)?(bench|soak|demo)[^/]*|(.*/)?(vllm_serve|testing)\.py)"
)


def build(out: Path, python: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("session_gate-*.whl"):
        old.unlink()
    maturin = Path(python).parent / "maturin"
    # Stripped (pyproject.toml's `strip = true`), as `maturin develop` builds it.
    cmd = [str(maturin) if maturin.exists() else "maturin", "build", "--release"]
    cmd += ["--auditwheel", "check", "--interpreter", python, "--out", str(out)]
    subprocess.run(cmd, cwd=ROOT, check=True)
    wheels = sorted(out.glob("session_gate-*.whl"))
    if len(wheels) != 1:
        sys.exit(f"expected one wheel in {out}, found {[w.name for w in wheels]}")
    return wheels[0]


def metadata(wheel: zipfile.ZipFile, name: str) -> str:
    (path,) = [n for n in wheel.namelist() if n.endswith(f".dist-info/{name}")]
    return wheel.read(path).decode()


def describe(path: Path) -> list[str]:
    """Prints what is in the wheel; returns the promises it breaks."""
    problems = []
    with zipfile.ZipFile(path) as wheel:
        infos = wheel.infolist()
        tags = [
            line.split(": ", 1)[1]
            for line in metadata(wheel, "WHEEL").splitlines()
            if line.startswith("Tag: ")
        ]
        entry_points = metadata(wheel, "entry_points.txt")
        requires = [
            line.split(": ", 1)[1]
            for line in metadata(wheel, "METADATA").splitlines()
            if line.startswith("Requires-Dist: ")
        ]
    size = path.stat().st_size
    unpacked = sum(i.file_size for i in infos)
    print(f"wheel: {path.name}")
    print(f"size: {size / 1e6:.2f} MB ({size:,} bytes; {unpacked / 1e6:.2f} MB unpacked)")
    print(f"tags: {', '.join(tags)}")
    print("entry points:")
    print("".join(f"  {line}\n" for line in entry_points.strip().splitlines()), end="")
    print(f"requires: {', '.join(requires) or 'nothing'}")
    print(f"contents ({len(infos)} files):")
    for info in sorted(infos, key=lambda i: i.filename):
        print(f"  {info.file_size:>12,}  {info.filename}")

    if not any("manylinux" in tag for tag in tags):
        problems.append(f"no manylinux tag: {tags}")
    sections = _sections(entry_points)
    for section, line in ENTRY_POINTS.items():
        if line.replace(" ", "") not in {e.replace(" ", "") for e in sections.get(section, [])}:
            problems.append(f"entry point missing: [{section}] {line}")
    lab = [i.filename for i in infos if LAB_FILE.fullmatch(i.filename)]
    if lab:
        problems.append(f"lab code in the wheel (pyproject.toml's exclude): {lab}")
    runtime = [r for r in requires if "extra ==" not in r]
    if runtime:
        problems.append(f"runtime requirements (vLLM's environment must be enough): {runtime}")
    return problems


def _sections(text: str) -> dict[str, list[str]]:
    sections: dict[str, list[str]] = {}
    current = ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("[") and line.endswith("]"):
            current = line[1:-1]
        elif line:
            sections.setdefault(current, []).append(line)
    return sections


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "dist")
    parser.add_argument("--python", default=sys.executable, help="the CPython to build for")
    args = parser.parse_args()
    path = build(args.out.resolve(), args.python)
    problems = describe(path)
    for problem in problems:
        print(f"wheel: {problem}", file=sys.stderr)
    if problems:
        sys.exit(1)
    print(path)


if __name__ == "__main__":
    main()
