"""core/ and sched/ import without torch (DESIGN.md: their tests are the fast heart)."""

from __future__ import annotations

import subprocess
import sys


def test_core_and_sched_do_not_import_torch() -> None:
    """Importing blockserve.core and blockserve.sched loads neither torch nor numpy."""
    code = (
        "import sys, blockserve.core, blockserve.sched, blockserve.config, blockserve.cli;"
        "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
