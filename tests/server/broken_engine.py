"""`blockserve serve` whose engine loop dies at its first step, for the exit-code test:
`python -m tests.server.broken_engine serve ...`."""

from __future__ import annotations

import sys

from blockserve.cli import main
from blockserve.engine.llm_engine import LLMEngine


def broken_step(self: LLMEngine) -> list[object]:
    raise RuntimeError("the loop itself broke")


if __name__ == "__main__":
    LLMEngine.step = broken_step  # type: ignore[assignment, method-assign]
    sys.exit(main(sys.argv[1:]))
