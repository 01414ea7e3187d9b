"""The model runner: KV cache tensors, SchedulerOutput → model inputs, forward, sampling.

Modules:

  kv_cache.py         cache sizing and allocation, the context it holds (on a CPU one anonymous
                      mapping, zero without a write, each page mapped in when first written)
  kv_budget.py        the cache's bytes: the flags' precedence, VLLM_CPU_KVCACHE_SPACE,
                      --gpu-memory-utilization (a profiled step's peak on CUDA)
  page_mapping.py     keeps page faults out of CPU steps: maps the next never-used blocks' pages
                      in ahead, on an idle-priority thread; has glibc keep freed memory for the
                      next step's temporaries
  inputs.py           a step's flat batch: token ids, positions, slots, block tables
  decode_graphs.py    CUDA graphs for decode batches: the sizes (vLLM's), static inputs padded
                      to the bucket, capture at start-up, replay
  build.py            runner_parts: the device, backend, KV cache (sized), weights and their
                      fused operators, sampler, grammar compiler and compiled forward, assembled
                      in one place; build_runner (tests, model benchmarks)
  request_states.py   what the runner keeps of each running request; fills placeholders, records
                      sampled tokens
  images.py           StepImages: running requests' images, each encoded once by the vision
                      tower, and the tokens a step's image positions take
  prompt_logprobs.py  prompt_logprobs: each prompt token's logprob from the prefill rows, chunk
                      by chunk, handed over with the first sampled token
  launched.py         LaunchedStep: a step on the device not read back yet; its tokens fill the
                      next step's placeholders there
  model_runner.py     ModelRunner, which only runs steps: SchedulerOutput → inputs → forward
                      (eager or compiled) → logits where sampled → grammar masks → tokens (each
                      fed to its sample's matcher)
  dummy_steps.py      steps over no request before the runner exists: the warm-up that traces a
                      forward, the memory profile that sizes the cache
  start.py            start_runner: the engine's one entry: parts, context length, device
                      warm-up, decode graphs, the runner; RunnerInfo and the KV view the engine
                      reads
"""

from __future__ import annotations

from blockserve.runner.model_runner import ModelRunner

__all__ = ["ModelRunner"]
