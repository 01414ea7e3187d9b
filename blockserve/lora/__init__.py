"""LoRA adapters: PEFT adapters read and checked (adapter.py), the slot pool and the wrapped
projections (layers.py), the runner's registry and per-step grouping (manager.py)."""
