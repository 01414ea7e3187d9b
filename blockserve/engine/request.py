"""The request types that cross the engine: what a caller asks for, what passed validation,
and what the engine core runs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, cast

from blockserve.errors import InvalidRequestError
from blockserve.multimodal.inputs import ImageInput
from blockserve.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class ImagesPrompt:
    """Text with an `<image>` placeholder for each image (vLLM's `{"prompt": ...,
    "multi_modal_data": {"image": ...}}`); the images are PIL images. `uuids`, one per image
    or empty (vLLM's `multi_modal_uuids`), stand for the images in the cache where given."""

    text: str
    images: tuple[Any, ...]
    uuids: tuple[str | None, ...] = ()


TextPrompt = str | tuple[int, ...]
Prompt = TextPrompt | ImagesPrompt


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One generation request as a caller states it. `prompt` is text or token ids.

    `RequestSpec` is built by the HTTP layer and by `LLM`; `InputProcessor` turns it into a
    `ValidatedRequest` (the one place requests are checked); the output processor fans that out
    into one `EngineCoreRequest` per sample, keyed by a structured `SampleId`. All three are
    frozen plain data: they can cross a thread or a process as they are.
    """

    request_id: str
    prompt: Prompt
    params: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0
    cache_salt: str | None = None
    lora_name: str | None = None
    explain_cache: bool = False  # report why the prefix-cache match stopped (usage)
    # The scheduler's fairness unit (sched/fair_share.py): requests of one group share one
    # share of the sequence slots, as one HTTP request's prompts do; None: this request alone.
    group_id: str | None = None
    # A token-id prompt's images, rendered with it (a chat's image parts): their spans in it.
    images: tuple[ImageInput, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.prompt, str | ImagesPrompt):
            object.__setattr__(self, "prompt", tuple(self.prompt))


@dataclass(frozen=True, slots=True)
class ValidatedRequest:
    """A spec that passed every check, with its prompt tokenized; below here it is trusted."""

    spec: RequestSpec
    prompt_token_ids: tuple[int, ...]
    images: tuple[ImageInput, ...] = ()  # their identifiers, spans and tiles

    @property
    def request_id(self) -> str:
        return self.spec.request_id

    @property
    def prompt_text(self) -> str | None:
        prompt = self.spec.prompt
        return (
            prompt.text
            if isinstance(prompt, ImagesPrompt)
            else prompt
            if isinstance(prompt, str)
            else None
        )


class SampleId(NamedTuple):
    """The engine core's id of one sample: its request's id and its index among the `n`.
    A tuple, not a string, so no caller's id can collide with another's sample."""

    request_id: str
    sample_index: int


@dataclass(frozen=True, slots=True)
class EngineCoreRequest:
    """One sample as the engine core runs it: token ids in, token ids out."""

    request_id: SampleId
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    lora_name: str | None = None
    explain_cache: bool = False
    group_id: str = ""  # "": the request's own id (every sample of it, one group)
    images: tuple[ImageInput, ...] = ()


PromptInput = str | Sequence[int] | Mapping[str, Any]


def as_prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> list[TextPrompt]:
    """Text and token-id prompts alone (what an HTTP body holds): a prompt dict with images
    is refused."""
    listed = as_prompts(prompts)
    if any(isinstance(prompt, ImagesPrompt) for prompt in listed):
        raise InvalidRequestError("images are given offline only (multi_modal_data)", "prompt")
    return cast(list[TextPrompt], listed)


def as_prompts(prompts: PromptInput | Sequence[PromptInput]) -> list[Prompt]:
    """One prompt per entry from the shapes callers accept: a string, a list of token ids,
    vLLM's prompt dicts (`{"prompt": text}`, `{"prompt_token_ids": ids}`), or a list of any of
    them. An empty list, or an entry of another shape, is refused."""
    if isinstance(prompts, str | Mapping):
        return [_one_prompt(prompts)]
    if not prompts:
        raise InvalidRequestError("prompt must not be empty", "prompt")
    if all(isinstance(t, int) for t in prompts):
        return [tuple(cast(Sequence[int], prompts))]
    return [_one_prompt(p) for p in cast(Sequence[Any], prompts)]


def _images(data: Any, key: str = "multi_modal_data") -> tuple[Any, ...]:
    """`multi_modal_data`'s images, `{"image": image}` or `{"image": [image, ...]}`, or
    `multi_modal_uuids`' uuids in the same shape."""
    if not isinstance(data, Mapping) or set(data) != {"image"}:
        raise InvalidRequestError(f"{key} holds 'image' alone (one or a list)", key)
    images = data["image"]
    return tuple(images) if isinstance(images, list | tuple) else (images,)


IMAGES_PROMPT_KEYS = {"prompt", "multi_modal_data", "multi_modal_uuids"}


def _images_prompt(prompt: Mapping[str, Any]) -> ImagesPrompt:
    """vLLM's `{"prompt", "multi_modal_data", "multi_modal_uuids"?}`: a uuid for each image,
    a string or None (the image hashed by its pixels)."""
    images = _images(prompt["multi_modal_data"])
    if "multi_modal_uuids" not in prompt:
        return ImagesPrompt(prompt["prompt"], images)
    uuids = _images(prompt["multi_modal_uuids"], "multi_modal_uuids")
    if len(uuids) != len(images) or not all(u is None or (isinstance(u, str) and u) for u in uuids):
        raise InvalidRequestError(
            f"multi_modal_uuids holds a non-empty string or None for each of the {len(images)} "
            "images",
            "multi_modal_uuids",
        )
    return ImagesPrompt(prompt["prompt"], images, uuids)


def _one_prompt(prompt: Any) -> Prompt:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Mapping):
        if set(prompt) == {"prompt"} and isinstance(prompt["prompt"], str):
            return prompt["prompt"]
        if set(prompt) == {"prompt_token_ids"} and isinstance(prompt["prompt_token_ids"], Sequence):
            return tuple(prompt["prompt_token_ids"])
        keys = set(prompt)
        with_images = {"prompt", "multi_modal_data"} <= keys <= IMAGES_PROMPT_KEYS
        if with_images and isinstance(prompt["prompt"], str):
            return _images_prompt(prompt)
        raise InvalidRequestError(
            "a prompt dict holds 'prompt' (a string) or 'prompt_token_ids' (token ids) alone; "
            f"got the keys {sorted(map(str, prompt))}",
            "prompt",
        )
    if isinstance(prompt, Sequence):
        return tuple(prompt)
    raise InvalidRequestError(
        f"a prompt is a string, token ids or a prompt dict; got {type(prompt).__name__}", "prompt"
    )


def image_part(part: Mapping[str, Any]) -> dict[str, Any]:
    """An OpenAI `image_url` content part as the input processor takes it: `{"type": "image",
    "url", "uuid"}` (the URL as given, or inside `{"url": ...}`; the client's uuid, vLLM's)."""
    url = part.get("image_url")
    url = url.get("url") if isinstance(url, Mapping) else url
    if not isinstance(url, str):
        raise InvalidRequestError("an image_url part holds a URL string", "messages")
    uuid = part.get("uuid")
    if uuid is not None and not (isinstance(uuid, str) and uuid):
        raise InvalidRequestError("an image part's uuid is a non-empty string", "messages")
    return {"type": "image", "url": url, "uuid": uuid}
