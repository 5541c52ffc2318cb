"""``Utility``: a ``session_gate_*`` method on vLLM's ``EngineCore`` that vLLM can call cheaply.

On every utility call vLLM runs ``inspect.signature`` on the method it looked up
(``EngineCoreProc._convert_msgspec_args``, looking for msgspec arguments to convert): for a
bound method that is 17-75 µs of engine loop per call on a 2-core VM, longer than a probe or an
admit itself. So the first lookup on an engine builds the bound form once, a
``functools.partial`` carrying a precomputed ``__signature__`` (which ``inspect.signature``
returns as it is), and caches it in the engine's ``__dict__``, where every later lookup finds it
before this (non-data) descriptor. Shared by the probes (``methods``) and the engine gate
(``gate_methods``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any


class Utility:
    """``fn(core, ...)`` installed on ``EngineCore``; what vLLM calls is ``bind(core)`` if given
    (the callable that does the work, e.g. a native method, so no Python frame of ``fn`` runs),
    else ``fn`` bound to the core. Either way it takes ``fn``'s parameters after ``self``."""

    def __init__(self, fn: Any, bind: Callable[[Any], Callable[..., Any]] | None = None) -> None:
        self.fn = fn
        self.__doc__ = fn.__doc__
        self._bind = bind
        params = list(inspect.signature(fn).parameters.values())[1:]  # without ``self``
        self.signature = inspect.Signature(params)

    def __get__(self, core: Any, owner: Any = None) -> Any:
        if core is None:
            return self
        if self._bind is None:
            bound = functools.partial(self.fn, core)
        else:  # a partial of no arguments: it can carry a signature, a builtin method cannot
            bound = functools.partial(self._bind(core))
        bound.__signature__ = self.signature  # type: ignore[attr-defined]
        core.__dict__[self.fn.__name__] = bound
        return bound

    def __call__(self, core: Any, *args: Any) -> Any:
        """``EngineCore.session_gate_x(core, ...)``, as a plain function would take it."""
        return self.__get__(core)(*args)
