"""A plugin whose native module cannot load disables its probes, warns why, and vLLM still serves.

Runs a real engine in a subprocess whose ``PYTHONPATH`` puts a copy of the ``session_gate``
package without its compiled module first, so the installed entry point finds no ``_native``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import session_gate

SCRIPT = textwrap.dedent(
    """
    import json
    from vllm import SamplingParams
    from session_gate.lab.engine.launch import make_llm

    if __name__ == "__main__":
        llm = make_llm(num_blocks=32)
        out = llm.generate([{"prompt_token_ids": list(range(5, 90))}],
                           SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        core = llm.llm_engine.engine_core
        usage = core.call_utility("session_gate_usage")
        probe = core.call_utility("session_gate_probe", "s", list(range(5, 90)))
        print("RESULT " + json.dumps({
            "generated": len(out[0].outputs[0].token_ids), "usage": usage, "probe": probe}))
        core.shutdown()
    """
)


def test_vllm_serves_and_warns_when_the_native_module_is_missing(tmp_path: Path):
    package = Path(session_gate.__file__).parent
    shutil.copytree(
        package,
        tmp_path / "session_gate",
        ignore=shutil.ignore_patterns("_native*.so", "_native*.pyd", "__pycache__"),
    )
    (tmp_path / "run.py").write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "run.py")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    result = json.loads(output.split("RESULT ", 1)[1].splitlines()[0])
    assert result["generated"] == 4
    assert result["usage"]["num_blocks"] == 31
    assert result["probe"]["available"] is False
    assert "native module failed to load" in result["probe"]["reason"]
    assert "session_gate: session_gate native module failed to load" in output
