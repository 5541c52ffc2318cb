"""Every vLLM symbol the patch ledger lists still exists in the installed vLLM."""

from __future__ import annotations

import importlib
import inspect

import pytest
from session_gate.engine.ledger import LEDGER

CHECKS = [check for patch in LEDGER for check in patch.checks]


def test_every_ledger_entry_names_what_it_checks():
    assert all(patch.checks for patch in LEDGER)


@pytest.mark.parametrize("check", CHECKS)
def test_ledger_symbol_resolves(check):
    module_name, path = check.split(":")
    obj = importlib.import_module(module_name)
    attr_path, _, instance_attr = path.partition("#")
    for name in attr_path.split("."):
        obj = getattr(obj, name)
    if instance_attr:
        # An attribute the class sets on its instances: it must appear in __init__ or slots.
        source = inspect.getsource(obj.__init__)
        assert f"self.{instance_attr}" in source or instance_attr in getattr(obj, "__slots__", ())


def test_scheduler_mode_wraps_the_signatures_it_spells_out():
    """``gate_scheduler`` wraps ``_handle_blocked_waiting_request(self, request)`` with that
    very signature, and reads the ``session_id`` that ``AsyncLLM.generate`` takes."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.async_llm import AsyncLLM

    handle = inspect.signature(Scheduler._handle_blocked_waiting_request)
    assert list(handle.parameters) == ["self", "request"]
    assert "session_id" in inspect.signature(AsyncLLM.generate).parameters
