"""`LLM`: the offline API, shaped like vLLM's — build once, then `generate` or `chat`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from blockserve.config import CacheConfig, ModelConfig, SchedulerConfig
from blockserve.engine.llm_engine import EngineStats, LLMEngine, Prompt
from blockserve.engine.outputs import RequestOutput
from blockserve.events.config import KVEventsConfig
from blockserve.sampling_params import SamplingParams

Message = dict[str, str]


class LLM:
    """An engine driven to completion on each call.

    >>> llm = LLM()                                   # the embedded SmolLM2-135M-Instruct
    >>> out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))
    >>> out[0].outputs[0].text, out[0].num_cached_tokens
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        enable_prefix_caching: bool = True,
        block_size: int = 16,
        prefix_caching_hash_algo: str = "sha256",
        eviction_policy: str = "lru",
        scheduling_policy: str = "fcfs",
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        kv_cache_memory_bytes: int | None = None,
        num_gpu_blocks_override: int | None = None,
        max_model_len: int | None = None,
        dtype: str = "auto",
        seed: int = 0,
        device: str = "auto",
        attention_backend: str = "auto",
        kv_events_config: KVEventsConfig | dict[str, Any] | str | None = None,
    ) -> None:
        if isinstance(kv_events_config, str):
            kv_events_config = KVEventsConfig.from_json(kv_events_config)
        elif isinstance(kv_events_config, dict):
            kv_events_config = KVEventsConfig(**kv_events_config)
        self.engine = LLMEngine(
            ModelConfig(
                model=model,
                dtype=dtype,
                device=device,
                attention_backend=attention_backend,
                max_model_len=max_model_len,
                seed=seed,
            ),
            CacheConfig(
                block_size=block_size,
                enable_prefix_caching=enable_prefix_caching,
                prefix_caching_hash_algo=prefix_caching_hash_algo,
                eviction_policy=eviction_policy,
                num_gpu_blocks_override=num_gpu_blocks_override,
                kv_cache_memory_bytes=kv_cache_memory_bytes,
            ),
            SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                policy=scheduling_policy,
            ),
            kv_events_config,
        )
        self._next_id = 0

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
        cache_salt: str | Sequence[str | None] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        A prompt is a string or a list of token ids. `sampling_params`, `priority` and
        `cache_salt` are one value for all prompts or one per prompt.
        """
        prompt_list = _as_prompt_list(prompts)
        count = len(prompt_list)
        params = _per_prompt(sampling_params or SamplingParams(), count, "sampling_params")
        priorities = _per_prompt(0 if priority is None else priority, count, "priority")
        salts = _per_prompt(cache_salt, count, "cache_salt")
        request_ids = []
        try:
            for prompt, p, prio, salt in zip(prompt_list, params, priorities, salts, strict=True):
                request_id = str(self._next_id)
                self._next_id += 1
                self.engine.add_request(request_id, prompt, p, prio, salt)
                request_ids.append(request_id)
            return self._run(request_ids, use_tqdm)
        except BaseException:
            self.engine.abort_request(request_ids)  # leave no half-run batch behind
            raise

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.engine.tokenizer
        prompts = [
            tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
            for conv in conversations
        ]
        token_prompts = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        return self.generate(token_prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(request_ids)
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(request_ids), desc="Generating", disable=not use_tqdm) as bar:
            while pending:
                for output in self.engine.step():
                    if output.finished and output.request_id in pending:
                        pending.discard(output.request_id)
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[request_id] for request_id in request_ids]

    def get_stats(self) -> EngineStats:
        """Prefix-cache queries and hits, KV usage, preemptions, token counts."""
        return self.engine.get_stats()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (emits AllBlocksCleared); False while requests run."""
        return self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        """Flush and close the KV event publisher, if any."""
        self.engine.shutdown()


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]  # type: ignore[arg-type]
    return list(prompts)  # type: ignore[arg-type]


def _per_prompt(value: Any, count: int, name: str) -> list[Any]:
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"{name} has {len(value)} entries for {count} prompts")
        return list(value)
    return [value] * count
