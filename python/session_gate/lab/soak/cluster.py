"""The soak run's processes: two ``vllm serve`` replicas (tiny model, dummy weights, CPU, small KV
cache) with the session_gate plugin, and ``session-gate proxy`` (release build) in front. A
replica can be killed (SIGKILL of its process group: no clean shutdown) and restarted at the
same address. Also the readings: the proxy's RSS and Prometheus samples. The fleet bench
(``bench.fleet``) starts the same replicas once and a proxy of its own per run in front of them.

Nothing here imports vLLM: every server is a subprocess (``engine.serve``)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from session_gate.lab.engine.serve import proxy_binary, start_proxy, start_vllm, stop


@dataclass
class Engines:
    """Engine shape: small enough that two replicas and the proxy fit beside other work."""

    #: vLLM keeps one block back (the null block): the rest must hold ``max_model_len``.
    num_blocks: int = 128
    block_size: int = 32
    max_model_len: int = 1024
    max_num_seqs: int = 16
    #: vLLM's ``--max-num-batched-tokens``; ``None``: ``max_model_len``.
    max_num_batched_tokens: int | None = None
    timeout: float = 900
    #: Added to each engine's environment (the engine gate's ``SESSION_GATE_*`` knobs).
    env: dict[str, str] = field(default_factory=dict)
    #: Added to replica ``i``'s environment after ``env`` (its own CPU cores, say), by index.
    replica_env: list[dict[str, str]] = field(default_factory=list)
    #: More ``vllm serve`` flags, for every replica.
    extra_args: list[str] = field(default_factory=list)


@dataclass
class Cluster:
    """Two replicas and the proxy; :meth:`close` stops whatever is still running."""

    engines: Engines
    proxy_args: list[str]
    release: bool = True
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="sg-soak-")))
    procs: list[subprocess.Popen | None] = field(default_factory=list)
    urls: list[str] = field(default_factory=list)
    proxy: subprocess.Popen | None = None
    proxy_url: str = ""
    restarts: int = 0
    #: The proxy binary, built at the first proxy start.
    binary: Path | None = None

    def _start_replica(self, i: int, port: int | None = None) -> tuple[subprocess.Popen, str]:
        e = self.engines
        workdir = self.workdir / f"replica{i}-{self.restarts if port else 0}"
        workdir.mkdir(parents=True, exist_ok=True)
        batched = e.max_num_batched_tokens or e.max_model_len
        extra = ["--max-num-seqs", str(e.max_num_seqs), "--max-num-batched-tokens",
                 str(batched), "--seed", "0", *e.extra_args]  # fmt: skip
        env = {**e.env, **(e.replica_env[i] if i < len(e.replica_env) else {})}
        return start_vllm(
            workdir,
            num_blocks=e.num_blocks,
            block_size=e.block_size,
            max_model_len=e.max_model_len,
            extra_args=extra,
            timeout=e.timeout,
            port=port,
            env=env,
        )

    def start(self) -> None:
        """Both replicas, then the proxy (``proxy_args``) in front of them."""
        self.start_replicas()
        self.start_proxy(self.proxy_args)

    def start_replicas(self) -> None:
        """Both replicas, side by side; if either fails, the one that started is left for
        :meth:`close`."""
        self.procs = [None, None]
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(self._start_replica, i) for i in range(2)]
        for i, f in enumerate(futures):
            if f.exception() is None:
                self.procs[i], url = f.result()
                self.urls.append(url)
        for f in futures:
            if f.exception() is not None:
                raise f.exception()  # type: ignore[misc]

    def start_proxy(self, proxy_args: list[str]) -> None:
        """``session-gate proxy`` with ``proxy_args`` in front of both replicas, in place of
        the one running (if any)."""
        self.stop_proxy()
        self.binary = self.binary or proxy_binary(self.release)
        args = ["--replica", self.urls[1], *proxy_args]
        self.proxy, self.proxy_url = start_proxy(self.binary, self.urls[0], self.workdir, args)

    def stop_proxy(self) -> None:
        if self.proxy is not None:
            stop(self.proxy)
            self.proxy, self.proxy_url = None, ""

    def kill(self, i: int) -> None:
        """SIGKILL replica ``i``'s process group (API server, engine core, workers)."""
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)

    def restart(self, i: int) -> None:
        """Start replica ``i`` again at its old address (blocks until it is healthy)."""
        self.restarts += 1
        port = int(self.urls[i].rsplit(":", 1)[1])
        self.procs[i], _ = self._start_replica(i, port=port)

    def alive(self) -> list[bool]:
        return [p is not None and p.poll() is None for p in self.procs]

    def proxy_rss_kib(self) -> int:
        """The proxy's resident set (``VmRSS``), KiB."""
        assert self.proxy is not None
        for line in Path(f"/proc/{self.proxy.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        return -1

    def close(self) -> None:
        self.stop_proxy()
        for p in self.procs:
            if p is not None:
                stop(p)
        shutil.rmtree(self.workdir, ignore_errors=True)


def get_text(url: str, timeout: float = 30) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def samples(text: str, name: str) -> dict[str, float]:
    """Every sample of ``name``: its label text → value."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            head, value = line.rsplit(" ", 1)
            out[head[len(name) :] or "{}"] = float(value)
    return out
