"""The running requests' images (a vision-language model's) and the encoder cache's tensors: the
vision tower's tokens of each image, by identifier, computed in the step the scheduler chose
(the step's images batched through the tower) and dropped when the scheduler evicts them; for
each step, the tokens of the image positions it computes."""

from __future__ import annotations

import time

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
        self.encoded: dict[str, torch.Tensor] = {}  # identifier -> the tower's tokens
        self.encode_seconds = 0.0  # the tower's time, all steps together (host-timed)
        self.num_encoded = 0  # images the tower ran on, since the start

    def add(self, request_id: RequestId, images: tuple[ImageInput, ...]) -> None:
        """A request's images, before its first step."""
        self.images[request_id] = images

    def update(self, scheduler_output: SchedulerOutput) -> None:
        """Forget the finished requests' images and drop what the scheduler evicted (every
        step, an empty one too)."""
        for request_id in scheduler_output.finished_request_ids:
            self.images.pop(request_id, None)
        for identifier in scheduler_output.freed_encoder_ids:
            self.encoded.pop(identifier, None)

    def for_step(
        self, scheduler_output: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows of the step's flat batch, the tower's tokens for them), or None when the step
        computes no image position. The step's images to encode go through the tower first."""
        self._encode(
            [
                self.images[request_id][index]
                for request_id, index in scheduler_output.encoder_inputs
            ]
        )
        rows: list[np.ndarray] = []
        tokens: list[torch.Tensor] = []
        start = 0
        for scheduled in scheduler_output.scheduled:
            first = scheduled.num_computed_tokens
            end = first + scheduled.num_scheduled_tokens
            for image in self.images.get(scheduled.request_id, ()):
                if image.offset >= end or image.offset + image.length <= first:
                    continue
                positions = image.offset + np.asarray(image.embed_positions)
                inside = (positions >= first) & (positions < end)
                if not inside.any():
                    continue
                if image.identifier not in self.encoded:
                    # Chosen for a step that a preemption cancelled: encoded now.
                    self._encode([image])
                rows.append(start + positions[inside] - first)
                chosen = torch.from_numpy(np.flatnonzero(inside))
                tokens.append(self.encoded[image.identifier][chosen])
            start += scheduled.num_scheduled_tokens
        if not rows:
            return None
        flat = torch.from_numpy(np.concatenate(rows)).to(self.device)
        return flat, torch.cat(tokens)

    def _encode(self, images: list[ImageInput]) -> None:
        """The images not yet held, through the tower in one batch of their tiles."""
        todo = list({i.identifier: i for i in images if i.identifier not in self.encoded}.values())
        if not todo:
            return
        began = time.perf_counter()
        pixels = np.concatenate([image.pixel_values for image in todo])
        tokens = self.vision.encode(pixels, self.dtype)
        sizes = [len(image.embed_positions) for image in todo]
        for image, part in zip(todo, tokens.split(sizes), strict=True):
            self.encoded[image.identifier] = part
        self.encode_seconds += time.perf_counter() - began
        self.num_encoded += len(todo)
