"""Counts Triton's kernel compilations while in use (its post-compile hook): how a run shows
that nothing compiled after the engine was ready."""

from __future__ import annotations

from types import TracebackType
from typing import Any


class TritonCompiles:
    """`with TritonCompiles() as compiles:` ... `compiles.kernels` names each kernel compiled
    inside (a new specialization of it); any hook installed before is called as well."""

    def __init__(self) -> None:
        self.kernels: list[str] = []
        self._previous: Any = None

    def __enter__(self) -> TritonCompiles:
        from triton import knobs

        self._previous = knobs.runtime.jit_post_compile_hook
        knobs.runtime.jit_post_compile_hook = self._compiled
        return self

    def _compiled(self, *args: Any, **kwargs: Any) -> Any:
        self.kernels.append(str(kwargs.get("repr", kwargs.get("key", "?"))))
        if self._previous is not None:
            return self._previous(*args, **kwargs)
        return None

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        from triton import knobs

        knobs.runtime.jit_post_compile_hook = self._previous
