"""`LLM`: the offline API, shaped like vLLM's — build once, then `generate` or `chat`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from blockserve.engine.args import EngineArgs
from blockserve.engine.chat import Message
from blockserve.engine.llm_engine import LLMEngine, build_engine
from blockserve.engine.outputs import EngineStats, RequestOutput
from blockserve.engine.request import PromptInput, RequestSpec, as_prompts
from blockserve.lora.adapter import LoRARequest
from blockserve.model.tokenizer import Tokenizer
from blockserve.sampling_params import SamplingParams


class LLM:
    """An engine driven to completion on each call.

    Keyword arguments are exactly `EngineArgs`' fields (the `blockserve serve` flags in
    snake_case); a bad value raises InvalidConfigError naming the field.

    >>> llm = LLM()                                   # the embedded SmolLM2-135M-Instruct
    >>> out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))
    >>> out[0].outputs[0].text, out[0].num_cached_tokens
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.engine: LLMEngine = build_engine(
            EngineArgs(model=model, **engine_args).create_configs()
        )
        self._next_id = 0

    def get_tokenizer(self) -> Tokenizer:
        """The served tokenizer: transformers' `encode`, `decode`, `apply_chat_template`,
        `convert_ids_to_tokens` with its results; `backend_tokenizer` is the `tokenizers` one."""
        return self.engine.input_processor.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation-config defaults (`--generation-config`),
        used when `generate` or `chat` is given none, as vLLM's `LLM` does."""
        return SamplingParams(**self.engine.default_sampling)  # type: ignore[arg-type]

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
        cache_salt: str | Sequence[str | None] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        A prompt is a string, a list of token ids, or vLLM's `{"prompt": text}` or
        `{"prompt_token_ids": ids}`. `sampling_params`, `priority`, `cache_salt` and
        `lora_request` (an adapter, read on first use) are one value for all prompts or one
        per prompt.
        """
        prompt_list = as_prompts(prompts)
        count = len(prompt_list)
        params = _per_prompt(
            sampling_params or self.get_default_sampling_params(), count, "sampling_params"
        )
        priorities = _per_prompt(0 if priority is None else priority, count, "priority")
        salts = _per_prompt(cache_salt, count, "cache_salt")
        loras = _per_prompt(lora_request, count, "lora_request")
        request_ids = []
        try:
            for prompt, p, prio, salt, lora in zip(
                prompt_list, params, priorities, salts, loras, strict=True
            ):
                request_id = str(self._next_id)
                self._next_id += 1
                name = self._lora_name(lora)
                self.engine.add_request(
                    RequestSpec(
                        request_id, prompt, p, priority=prio, cache_salt=salt, lora_name=name
                    )
                )
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
        """Apply the model's chat template to each conversation, then generate. Special-token
        text inside a message is plain text (engine/chat.py)."""
        one = bool(messages) and isinstance(messages[0], dict)
        conversations = [messages] if one else messages
        processor = self.engine.input_processor
        token_prompts = [list(processor.chat_prompt(c)) for c in conversations]  # type: ignore[arg-type]
        return self.generate(token_prompts, sampling_params, use_tqdm=use_tqdm)

    def _lora_name(self, lora: LoRARequest | None) -> str | None:
        """The adapter's name, once it is registered (read now on its first use)."""
        if lora is None:
            return None
        lora_names = self.engine.input_processor.lora_names
        if lora_names is not None and lora.lora_name not in lora_names:
            self.engine.add_lora(lora.lora_name, lora.lora_path)
        return lora.lora_name

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(request_ids)
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(request_ids), desc="Generating", disable=not use_tqdm) as bar:
            while pending:
                for output in self.engine.step(final_only=True):
                    if output.finished and output.request_id in pending:
                        pending.discard(output.request_id)
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[request_id] for request_id in request_ids]

    def get_stats(self) -> EngineStats:
        """Prefix-cache queries and hits, KV usage, preemptions, token counts."""
        return self.engine.stats()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (emits AllBlocksCleared); False while requests run."""
        return self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        """Flush and close the KV event publisher, if any, and stop mapping KV pages ahead."""
        self.engine.shutdown()


def _per_prompt(value: Any, count: int, name: str) -> list[Any]:
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"{name} has {len(value)} entries for {count} prompts")
        return list(value)
    return [value] * count
