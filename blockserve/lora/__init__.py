"""LoRA adapters: PEFT adapters read and checked (adapter.py), the slot pool and the wrapped
projections (layers.py), the runner's slots and per-step grouping (manager.py), the adapters
served (registry.py).

Modules:

  adapter.py   LoRARequest; a PEFT adapter read and checked against the model (its safetensors
               header whole before any weight), its scaling folded into B (whole, or a module at
               a time)
  host_set.py  adapters in host memory (--max-cpu-loras, LRU), read back between steps within a
               share of the step time
  layers.py    the slot pool (stacked A/B per projection), LoRALinear: each slot's tokens' x @ A
               @ B added to the fused projection's output slice
  manager.py   the path each served adapter hashes with, whether one can run now, slots for
               each step's adapters and its tokens' groups
  registry.py  AdapterRegistry: the adapters served (name -> path), the one record the input
               check, /v1/models, the routes and the runner read, from any thread
  names.py     what an adapter may be called; LoRAError (torch-free)
"""
