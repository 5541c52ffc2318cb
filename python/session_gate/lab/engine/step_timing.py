"""Times real engine steps of the tiny CPU engine, with what each step scheduled.

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``LLM.llm_engine``), so
one ``llm_engine.step()`` is one scheduler step plus the model run and output processing. The
scheduler's ``schedule`` is wrapped to record, per scheduled request, ``(scheduled tokens,
computed tokens before, num_tokens, num_output_tokens)`` — the inputs of the twin's cost model
(``session_gate._native.sim_step_features``). Async scheduling is off so each timed call is
exactly one step (the twin models steps one after another). The model runs in a separate worker
process pinned to one core (``distributed_executor_backend="mp"``), as in the bench's engine.

The engine is the bench's tiny one by default, or a user's own model and shape
(:class:`EngineSpec`: what ``python -m session_gate.lab.sim.calibrate``'s engine flags set), and
:func:`time_steps` reports the shape the engine really got (:func:`engine_record`): vLLM sizes
the KV cache from ``gpu_memory_utilization`` and may adjust the block size for its backend.

Used by ``python -m session_gate.lab.sim.calibrate``; an engine is started and shut down here.
"""

from __future__ import annotations

import gc
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

#: One scheduled request: (scheduled tokens, computed before, num_tokens, num_output_tokens).
Entry = tuple[int, int, int, int]


@dataclass
class Scenario:
    """Requests submitted together (``arrivals`` maps a step index to the requests added
    before that step); every prompt's tokens are fresh unless it names a shared prefix."""

    name: str
    arrivals: dict[int, list[tuple[int, int, int]]] = field(default_factory=dict)
    """step -> [(prefix key, prompt tokens, max_tokens)]; prefix key 0 means no sharing."""


@dataclass
class Replay:
    """An agentic workload's sessions replayed turn by turn, all sessions' turn ``t`` submitted
    together once every turn ``t - 1`` finished (no tool waits): steps with what the bench's
    steps hold — many requests, a shared system prompt, histories hitting or missing the
    prefix cache, a full cache evicting — which synthetic scenarios alone do not reproduce."""

    name: str
    sessions: list[tuple[int, int, list[tuple[int, int]]]]
    """(system tokens, task tokens, [(appended tokens, max_tokens) per turn]) per session."""


@dataclass
class TimedStep:
    scenario: str
    seconds: float
    entries: list[Entry]


@dataclass
class EngineSpec:
    """The engine to time: ``model`` None is the bench's tiny CPU engine (dummy weights, its
    shape by default); otherwise a user's model. Fields left None keep the tiny engine's value,
    or vLLM's own default for a user's model."""

    model: str | None = None
    load_format: str | None = None
    dtype: str | None = None
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    gpu_memory_utilization: float | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    tensor_parallel_size: int | None = None
    enforce_eager: bool | None = None
    trust_remote_code: bool = False

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``vllm.LLM``: prefix caching on, prompts as token ids, and
        async scheduling off so each timed call is one step."""
        from vllm.platforms import current_platform

        from session_gate.lab.engine.launch import tiny_engine_args

        given = {
            "load_format": self.load_format,
            "dtype": self.dtype,
            "block_size": self.block_size,
            "num_gpu_blocks_override": self.num_gpu_blocks,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_model_len": self.max_model_len,
            "tensor_parallel_size": self.tensor_parallel_size,
            "enforce_eager": self.enforce_eager,
        }
        given = {k: v for k, v in given.items() if v is not None}
        if self.model is None:
            # The bench's engine shape unless a flag says otherwise.
            kwargs = tiny_engine_args(
                num_blocks=self.num_gpu_blocks or 1024,
                block_size=self.block_size or 32,
                max_model_len=self.max_model_len,
                max_num_seqs=self.max_num_seqs or 16,
            )
            kwargs.update(given)
        else:
            kwargs = dict(model=self.model, enable_prefix_caching=True, seed=0, **given)
            if self.trust_remote_code:
                kwargs["trust_remote_code"] = True
        kwargs["skip_tokenizer_init"] = True
        kwargs["async_scheduling"] = False
        if current_platform.is_cpu():
            # The bench's engine (an AsyncLLM) runs the model in a worker process that vLLM's
            # CPU backend pins to one core (the other is reserved for the engine core);
            # in-process the default executor runs it unpinned in this process, and its steps
            # came out up to 1.7x faster than the bench's. Time the bench's kind of worker. On a
            # GPU vLLM's default executor is what `vllm serve` runs.
            kwargs["distributed_executor_backend"] = "mp"
        return kwargs


def engine_record(llm: Any) -> dict[str, Any]:
    """What the started engine really is: its replica shape (the KV blocks vLLM allocated,
    including the null block; the block size it uses; its scheduler limits), KV bytes per
    token over all tensor-parallel ranks, and the model, dtype and device."""
    import vllm
    from vllm.platforms import current_platform

    engine = llm.llm_engine
    config = engine.vllm_config
    kv = engine.engine_core.engine_core.scheduler.kv_cache_config
    block_size = config.cache_config.block_size
    tp = config.parallel_config.tensor_parallel_size
    per_rank = sum(g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in kv.kv_cache_groups)
    device = current_platform.device_name
    if current_platform.is_cuda_alike():
        import torch

        device = torch.cuda.get_device_name(0)
    return {
        "num_blocks": int(kv.num_blocks),
        "block_size": int(block_size),
        "max_num_seqs": int(config.scheduler_config.max_num_seqs),
        "max_num_batched_tokens": int(config.scheduler_config.max_num_batched_tokens),
        "kv_bytes_per_token": int(per_rank * tp // block_size),
        # What a served engine on this platform does (vLLM's CPU platform turns it off).
        "async_scheduling": not current_platform.is_cpu(),
        "model": str(config.model_config.model),
        "load_format": str(config.load_config.load_format),
        "dtype": str(config.model_config.dtype).removeprefix("torch."),
        "tensor_parallel_size": int(tp),
        "max_model_len": int(config.model_config.max_model_len),
        "gpu_memory_utilization": float(config.cache_config.gpu_memory_utilization),
        "num_gpu_blocks_override": config.cache_config.num_gpu_blocks_override,
        "enforce_eager": bool(config.model_config.enforce_eager),
        "device": str(device),
        "vllm_version": vllm.__version__,
    }


class EngineRefused(Exception):
    """vLLM would not start the engine asked for (its own checks of the configuration, or no
    room for the KV cache); the message is vLLM's."""


@dataclass
class Timing:
    """Every timed step, and the engine that ran them (:func:`engine_record`)."""

    steps: list[TimedStep]
    engine: dict[str, Any]


def calibration_scenarios(max_prompt: int = 8000) -> list[Scenario]:
    """Prefill sizes, cached prefixes, decode batch sizes and contexts, and mixed steps."""
    out: list[Scenario] = []
    for p in (32, 128, 512, 1024, 2048, 4096, max_prompt):
        out.append(Scenario(f"prefill-{p}", {0: [(0, p, 2)]}))
    for prefix in (1024, 4096):
        for new in (64, 512, 2048):
            key = prefix * 10 + new
            out.append(
                Scenario(
                    f"cached-{prefix}+{new}",
                    {0: [(key, prefix, 1)], 3: [(key, prefix + new, 2)]},
                )
            )
    for batch in (1, 2, 4, 8, 16):
        for ctx in (64, 1024, 3000):
            if batch * ctx > 30000:
                continue
            out.append(Scenario(f"decode-{batch}x{ctx}", {0: [(0, ctx, 24)] * batch}))
    out.append(
        Scenario(
            "mixed-8x512+2048",
            {0: [(0, 512, 40)] * 8, 6: [(0, 2048, 4)], 12: [(0, 6000, 2)]},
        )
    )
    out.append(Scenario("chunked-2x6000", {0: [(0, 6000, 3), (0, 6000, 3)]}))
    return out


def time_steps(
    scenarios: Iterable[Scenario],
    *,
    replays: Iterable[Replay] = (),
    repeats: int = 2,
    engine_spec: EngineSpec | None = None,
    seed: int = 0,
    progress: Any = None,
) -> Timing:
    """Runs every scenario ``repeats`` times, then every replay once, on one fresh engine
    (``engine_spec``, default the bench's tiny one); returns every step and the engine's record.
    A request longer than the engine's ``max_model_len`` is left out (a scenario's, or a replayed
    session's remaining turns)."""
    from vllm import LLM, SamplingParams

    from session_gate.lab.engine.launch import env_while

    try:
        # The engine core in this process, to time its steps; only for this engine: a bench
        # run after a calibration in the same process (sim-fidelity --refit) must get the
        # bench's own engine, whose core runs in a process of its own.
        with env_while("VLLM_ENABLE_V1_MULTIPROCESSING", "0"):
            llm = LLM(**(engine_spec or EngineSpec()).engine_kwargs())
    except (ValueError, TypeError, RuntimeError) as exc:
        # Pydantic's validation errors are ValueErrors; a KV cache that does not fit is a
        # ValueError or a RuntimeError (out of memory).
        raise EngineRefused(str(exc)) from exc
    record = engine_record(llm)
    max_len = record["max_model_len"]
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    sched = core.scheduler
    captured: list[list[Entry]] = []
    original = sched.schedule

    def schedule(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        entries = []
        for rid, n in out.num_scheduled_tokens.items():
            req = sched.requests[rid]
            # schedule() already advanced num_computed_tokens by n (_update_after_schedule).
            entries.append(
                (
                    int(n),
                    int(req.num_computed_tokens - n),
                    int(req.num_tokens),
                    int(req.num_output_tokens),
                )
            )
        captured.append(entries)
        return out

    sched.schedule = schedule
    rng = random.Random(seed)
    prefixes: dict[int, list[int]] = {}
    counter = 0
    steps: list[TimedStep] = []
    try:
        warm = [Scenario("warmup", {0: [(0, 256, 8)] * 4})]
        scenarios = [
            s
            for s in scenarios
            if all(p + m <= max_len for reqs in s.arrivals.values() for _, p, m in reqs)
        ]
        for rep, sc in enumerate(warm + [s for s in scenarios for _ in range(repeats)]):
            if progress:
                progress(sc.name)
            llm.reset_prefix_cache()
            prefixes.clear()
            step = 0
            pending = dict(sc.arrivals)
            while pending or engine.has_unfinished_requests():
                for key, plen, max_tokens in pending.pop(step, []):
                    if key and key in prefixes:
                        base = prefixes[key]
                        tokens = base + [rng.randrange(3, 4096) for _ in range(plen - len(base))]
                    else:
                        tokens = [rng.randrange(3, 4096) for _ in range(plen)]
                        if key:
                            prefixes[key] = tokens
                    counter += 1
                    engine.add_request(
                        f"cal-{counter}",
                        {"prompt_token_ids": tokens},
                        SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0),
                    )
                if not engine.has_unfinished_requests():
                    step += 1
                    continue
                captured.clear()
                gc.collect(0)
                t0 = time.perf_counter()
                engine.step()
                seconds = time.perf_counter() - t0
                step += 1
                if rep == 0 or len(captured) != 1 or not captured[0]:
                    continue  # the warm-up, or a call that scheduled nothing
                steps.append(TimedStep(sc.name, seconds, captured[0]))
        for replay in replays:
            if progress:
                progress(replay.name)
            llm.reset_prefix_cache()
            system = [rng.randrange(3, 4096) for _ in range(max(s[0] for s in replay.sessions))]
            histories = [
                system[:sys_tokens] + [rng.randrange(3, 4096) for _ in range(task)]
                for sys_tokens, task, _ in replay.sessions
            ]
            rounds = max(len(turns) for _, _, turns in replay.sessions)
            for t in range(rounds):
                live = {}
                for i, (_, _, turns) in enumerate(replay.sessions):
                    if t >= len(turns):
                        continue
                    append, max_tokens = turns[t]
                    if len(histories[i]) + append + max_tokens > max_len:
                        continue  # past the engine's max_model_len: the session stops here
                    histories[i] += [rng.randrange(3, 4096) for _ in range(append)]
                    counter += 1
                    live[f"cal-{counter}"] = i
                    engine.add_request(
                        f"cal-{counter}",
                        {"prompt_token_ids": list(histories[i])},
                        SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0),
                    )
                while engine.has_unfinished_requests():
                    captured.clear()
                    gc.collect(0)
                    t0 = time.perf_counter()
                    outputs = engine.step()
                    seconds = time.perf_counter() - t0
                    for out in outputs:
                        if out.finished and out.request_id in live:
                            histories[live[out.request_id]] += list(out.outputs[0].token_ids)
                    if len(captured) == 1 and captured[0]:
                        steps.append(TimedStep(replay.name, seconds, captured[0]))
    finally:
        sched.schedule = original
        del llm, engine, core
        gc.collect()
    return Timing(steps, record)


class StepLog:
    """Per-step records of a running ``AsyncLLM``, taken from vLLM's own stats
    (``StatLoggerBase.record``) with ``enable_logging_iteration_details`` on: the client's time,
    the engine's step counter, running / waiting requests, KV usage, prefix-cache queries and
    hits, prompt and generated tokens, preemptions, and per iteration the prefill ("context")
    and decode requests and tokens and how long the core blocked on the worker. The engine core
    only fills in what its stats already hold, plus a small per-step summary.

    ``factory()`` is a ``stat_loggers`` entry; ``mark(label)`` inserts a label row (the bench
    marks each mode's start)."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def async_llm(self, **kwargs: Any) -> Any:
        """``launch.make_async_llm(**kwargs)`` with this log among its stat loggers."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from session_gate.lab.engine.launch import tiny_engine_args

        # vLLM's own per-iteration details (prefill and decode requests and tokens of every
        # step, and how long the core blocked on the worker); its default loggers off, so the
        # details are not also printed line by line (stats stay on: a custom logger is given).
        engine_args = AsyncEngineArgs(
            **tiny_engine_args(**kwargs),
            enable_logging_iteration_details=True,
            disable_log_stats=True,
        )
        return AsyncLLM.from_engine_args(engine_args, stat_loggers=[self.factory()])

    def mark(self, label: str) -> None:
        self.rows.append({"mark": label, "t": time.time()})

    def factory(self) -> Any:
        from vllm.v1.metrics.loggers import StatLoggerBase

        rows = self.rows

        class _Recorder(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(
                self,
                scheduler_stats: Any,
                iteration_stats: Any,
                mm_cache_stats: Any = None,
                engine_idx: int = 0,
            ) -> None:
                row: dict[str, Any] = {"t": time.time()}
                if scheduler_stats is not None:
                    pc = scheduler_stats.prefix_cache_stats
                    row.update(
                        step=scheduler_stats.step_counter,
                        running=scheduler_stats.num_running_reqs,
                        waiting=scheduler_stats.num_waiting_reqs,
                        usage=round(scheduler_stats.kv_cache_usage, 4),
                        queries=pc.queries,
                        hits=pc.hits,
                        preempted_queries=pc.preempted_queries,
                        preempted_hits=pc.preempted_hits,
                    )
                    d = scheduler_stats.iteration_details
                    if d is not None:
                        row.update(
                            it=d.iteration_index,
                            ctx_reqs=d.num_ctx_requests,
                            ctx_tokens=d.num_ctx_tokens,
                            gen_reqs=d.num_generation_requests,
                            gen_tokens=d.num_generation_tokens,
                            blocked_ms=round(d.elapsed_ms, 3),
                        )
                if iteration_stats is not None:
                    row.update(
                        prompt=iteration_stats.num_prompt_tokens,
                        gen=iteration_stats.num_generation_tokens,
                        preempted=iteration_stats.num_preempted_reqs,
                        finished=len(iteration_stats.finished_requests),
                    )
                rows.append(row)

            def log_engine_initialized(self) -> None:
                pass

        return _Recorder
