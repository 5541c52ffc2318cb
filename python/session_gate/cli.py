"""The ``session-gate`` command the wheel installs (console script ``session_gate.cli:main``).

``session-gate sim …`` runs the replica twin's Python CLI (``session_gate.sim.__main__``);
everything else (``proxy``, ``--help``, ``--version``) is the Rust command line inside the
extension (``session_gate._native.cli``), the same parser the cargo-built binary uses. So one
wheel carries the plugin, the gate, the proxy and the twin, with no separate binary to install.
"""

from __future__ import annotations

import importlib
import signal
import sys
from collections.abc import Sequence

__all__ = ["main"]

_SIM_MODULE = "session_gate.sim.__main__"


def _run_sim(argv: list[str]) -> int:
    try:
        module = importlib.import_module(_SIM_MODULE)
    except ModuleNotFoundError as e:
        # Only a missing twin is explained here; an import error inside it is a bug to show.
        if e.name is None or not _SIM_MODULE.startswith(e.name):
            raise
        print(
            "session-gate sim: the replica twin is not in this installation "
            f"(cannot import {_SIM_MODULE}); install a session-gate release that includes it",
            file=sys.stderr,
        )
        return 2
    code = module.main(argv)
    return int(code or 0)


def _run_native(argv: list[str]) -> int:
    from . import _native

    # The proxy handles Ctrl-C itself (graceful shutdown) while the GIL is released. Python's
    # own SIGINT handler would otherwise leave a KeyboardInterrupt pending for when it returns.
    if hasattr(signal, "SIGINT"):
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    return _native.cli(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs ``session-gate`` with ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "sim":
        return _run_sim(args[1:])
    return _run_native(args)


if __name__ == "__main__":
    sys.exit(main())
