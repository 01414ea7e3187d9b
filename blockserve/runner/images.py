"""The images of the running requests (a vision-language model's), and for each step the
vision tower's tokens for the image positions it computes: each image is encoded once, when a
step first reaches its span, and kept until its request ends (a prefill chunked through an
image, or resumed after a prefix hit inside it, takes the rows it needs)."""

from __future__ import annotations

import numpy as np
import torch

from blockserve.core.kv_cache_manager import RequestId
from blockserve.model.vision import VisionModel
from blockserve.multimodal.inputs import ImageInput
from blockserve.sched.output import SchedulerOutput


class StepImages:
    def __init__(self, vision: VisionModel, dtype: torch.dtype, device: torch.device) -> None:
        self.vision, self.dtype, self.device = vision, dtype, device
        self.images: dict[RequestId, tuple[ImageInput, ...]] = {}
        # Each image's positions taking the tower's tokens, in order, and its tokens once run.
        self._positions: dict[tuple[RequestId, int], np.ndarray] = {}
        self._tokens: dict[tuple[RequestId, int], torch.Tensor] = {}

    def add(self, request_id: RequestId, images: tuple[ImageInput, ...], prompt: list[int]) -> None:
        """A request's images, before its first step; `prompt`, its token ids."""
        self.images[request_id] = images
        ids = np.asarray(prompt)
        for index, image in enumerate(images):
            span = np.arange(image.offset, image.offset + image.length)
            self._positions[request_id, index] = span[ids[span] == self.vision.image_token_id]

    def forget(self, request_ids: frozenset[RequestId]) -> None:
        for request_id in request_ids:
            for index in range(len(self.images.pop(request_id, ()))):
                self._positions.pop((request_id, index), None)
                self._tokens.pop((request_id, index), None)

    def for_step(
        self, scheduler_output: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows of the step's flat batch, the tower's tokens for them), or None when the step
        computes no image position."""
        rows: list[np.ndarray] = []
        tokens: list[torch.Tensor] = []
        start = 0
        for scheduled in scheduler_output.scheduled:
            first = scheduled.num_computed_tokens
            end = first + scheduled.num_scheduled_tokens
            for index, image in enumerate(self.images.get(scheduled.request_id, ())):
                if image.offset >= end or image.offset + image.length <= first:
                    continue
                key = (scheduled.request_id, index)
                positions = self._positions[key]
                inside = (positions >= first) & (positions < end)
                if not inside.any():
                    continue
                if key not in self._tokens:
                    self._tokens[key] = self.vision.embed(image, self.dtype)
                rows.append(start + positions[inside] - first)
                tokens.append(self._tokens[key][torch.from_numpy(np.flatnonzero(inside))])
            start += scheduled.num_scheduled_tokens
        if not rows:
            return None
        flat = torch.from_numpy(np.concatenate(rows)).to(self.device)
        return flat, torch.cat(tokens)
