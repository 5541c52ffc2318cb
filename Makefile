# session-gate: one-command set-up, tests, demo and benchmarks.
# Every target that needs vLLM runs `setup` first; set-up is idempotent and cached outside the
# checkout (SESSION_GATE_VENV, default ~/.cache/session-gate/venv).
SHELL := /bin/bash
VENV ?= $(or $(SESSION_GATE_VENV),$(HOME)/.cache/session-gate/venv)
PY := $(VENV)/bin/python
export SESSION_GATE_VENV := $(VENV)
# PyO3 (clippy with --features python) must see the same interpreter maturin builds for.
export PYO3_PYTHON := $(PY)

.PHONY: setup test test-rust test-python lint demo demo-probe bench bench-probe bench-gate clean

setup:
	bash scripts/setup.sh

test: setup lint test-rust test-python

lint: setup
	cargo fmt --check
	cargo clippy --all-targets -- -D warnings
	cargo clippy --all-targets --features python -- -D warnings
	$(VENV)/bin/ruff check python tests

test-rust:
	cargo test

test-python: setup
	$(PY) -m pytest -q tests/python

# The README's main job: the thrash benchmark's short version (no gate vs the default gate).
demo: setup
	$(PY) -m session_gate.bench --workload demo --modes none,gate --out bench-demo.json --plot bench-demo.png

# Every probe's answer beside vLLM's num_cached_tokens, turn by turn.
demo-probe: setup
	$(PY) -m session_gate.demo

# The full comparison: no gate, session caps, the seed's gate, the default gate; two workloads.
bench: setup
	$(PY) -m session_gate.bench --workload default mixed

bench-probe: setup
	$(PY) -m session_gate.engine.bench_probe

bench-gate: setup
	cargo run --release --quiet --example bench_gate
	$(PY) -m session_gate.bench_gate

clean:
	cargo clean
