"""SmolVLM's Hugging Face processor loads a video processor, which needs torchvision, absent from
the peer venv (the index has no CPU build for its torch). Images never touch it: loaded as
none, vLLM's SmolVLM processor works on images. Imported by sitecustomize.py beside it in a
vLLM server started with this folder on PYTHONPATH, and by
tests/multimodal/vllm_image_vectors.py."""

from __future__ import annotations

from typing import Any


class NoVideoProcessor:
    """What the processor loads in place of SmolVLM's video processor: nothing."""

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any) -> None:
        return None


def without_video_processor() -> None:
    """SmolVLM's HF processor loaded with no video processor, and accepted so."""
    from transformers import processing_utils

    names = processing_utils.MODALITY_TO_AUTOPROCESSOR_MAPPING._MAPPING_NAMES
    names["video_processor"] = (__name__, NoVideoProcessor.__name__)
    check = processing_utils.ProcessorMixin.check_argument_for_proper_class

    def allow_no_video(self: Any, name: str, argument: Any) -> Any:
        if name == "video_processor" and argument is None:
            return None
        return check(self, name, argument)

    processing_utils.ProcessorMixin.check_argument_for_proper_class = allow_no_video  # type: ignore[method-assign]
