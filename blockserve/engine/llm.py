"""`LLM`: the offline API, shaped like vLLM's — build once, then `generate` or `chat`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from tqdm import tqdm

from blockserve.engine.args import EngineArgs
from blockserve.engine.chat import Message
from blockserve.engine.llm_engine import LLMEngine, build_engine
from blockserve.engine.outputs import EngineStats, RequestOutput
from blockserve.engine.request import Prompt, PromptInput, RequestSpec, as_prompts, image_part
from blockserve.errors import InvalidRequestError
from blockserve.lora.adapter import LoRARequest
from blockserve.model.tokenizer import Tokenizer
from blockserve.multimodal.inputs import ImageInput
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
        return self._generate(
            prompt_list,
            [()] * len(prompt_list),
            sampling_params,
            priority,
            cache_salt,
            use_tqdm,
            lora_request,
        )

    def _generate(
        self,
        prompt_list: list[Prompt],
        images: list[tuple[ImageInput, ...]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        priority: Sequence[int] | None,
        cache_salt: str | Sequence[str | None] | None,
        use_tqdm: bool,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
    ) -> list[RequestOutput]:
        """Each prompt (with the images rendered into it, for a chat's) run to completion."""
        count = len(prompt_list)
        params = _per_prompt(
            sampling_params or self.get_default_sampling_params(), count, "sampling_params"
        )
        priorities = _per_prompt(0 if priority is None else priority, count, "priority")
        salts = _per_prompt(cache_salt, count, "cache_salt")
        loras = _per_prompt(lora_request, count, "lora_request")
        request_ids = []
        try:
            for prompt, prompt_images, p, prio, salt, lora in zip(
                prompt_list, images, params, priorities, salts, loras, strict=True
            ):
                request_id = str(self._next_id)
                self._next_id += 1
                name = self._lora_name(lora)
                self.engine.add_request(
                    RequestSpec(
                        request_id,
                        prompt,
                        p,
                        priority=prio,
                        cache_salt=salt,
                        lora_name=name,
                        images=prompt_images,
                    )
                )
                request_ids.append(request_id)
            return self._run(request_ids, use_tqdm)
        except BaseException:
            self.engine.abort_request(request_ids)  # leave no half-run batch behind
            raise

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate. Special-token
        text inside a message is plain text (engine/chat.py). A vision-language model takes
        OpenAI's content parts: `text`, `image_url` (a data:, http(s) or file:// URL) and
        vLLM's `image_pil` (a PIL image)."""
        one = bool(messages) and isinstance(messages[0], dict)
        conversations = cast(list[list[Message]], [messages] if one else messages)
        processor = self.engine.input_processor
        prompts: list[Prompt] = []
        images: list[tuple[ImageInput, ...]] = []
        for conversation in conversations:
            if any(isinstance(m.get("content"), list) for m in conversation):
                ids, rendered = processor.image_chat_prompt(offline_parts(conversation))
                prompts.append(ids)
                images.append(rendered)
            else:
                prompts.append(tuple(processor.chat_prompt(conversation)))
                images.append(())
        return self._generate(prompts, images, sampling_params, None, None, use_tqdm, None)

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


def offline_parts(conversation: list[Message]) -> list[dict[str, Any]]:
    """A conversation's content parts as the input processor takes them: text parts, and
    image parts holding a URL or, from `image_pil`, the image itself."""
    out: list[dict[str, Any]] = []
    for message in conversation:
        content: Any = message.get("content")
        if not isinstance(content, list):
            out.append(dict(message))
            continue
        parts: list[dict[str, Any]] = []
        for part in content:
            kind = part.get("type")
            if kind == "text":
                parts.append({"type": "text", "text": str(part.get("text", ""))})
            elif kind == "image_url":
                parts.append(image_part(part))
            elif kind == "image_pil":
                parts.append(
                    {"type": "image", "image": part.get("image_pil"), "uuid": part.get("uuid")}
                )
            else:
                raise InvalidRequestError(
                    f"content part type {kind!r} is not supported", "messages"
                )
        out.append({**message, "content": parts})
    return out
