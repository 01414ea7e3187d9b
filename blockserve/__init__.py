"""blockserve: an LLM inference-serving engine built around a hashed-block prefix cache.

The package root stays light: importing it loads no torch.
"""

from __future__ import annotations

__version__ = "0.1.0"
