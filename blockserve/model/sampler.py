"""The sampler: logits of the sampled positions → one token per request, batched on tensors."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from blockserve.kernels import CpuKernels
from blockserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class SamplingRow:
    """One request's sampling inputs for this step."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None
    banned_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling parameters as tensors; a None field means "off for every row"."""

    temperature: torch.Tensor  # [rows] float32; 0 marks a greedy row
    top_k: torch.Tensor | None  # [rows] int64; vocab size = off
    top_p: torch.Tensor | None  # [rows] float32
    min_p: torch.Tensor | None  # [rows] float32
    repetition_penalty: torch.Tensor | None  # [rows, 1]
    frequency_penalty: torch.Tensor | None  # [rows, 1]
    presence_penalty: torch.Tensor | None  # [rows, 1]
    seen_in_prompt: torch.Tensor | None  # [rows, vocab] bool
    output_counts: torch.Tensor | None  # [rows, vocab] float32
    banned: tuple[torch.Tensor, torch.Tensor] | None  # (row indices, token ids)
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (rows, token ids, values)
    generators: tuple[torch.Generator | None, ...]
    num_logprobs: int | None  # the largest top-N asked for; None = no logprobs
    all_greedy: bool

    @classmethod
    def build(
        cls, rows: Sequence[SamplingRow], vocab_size: int, device: torch.device
    ) -> SamplingBatch:
        params = [row.params for row in rows]

        def column(values: list[float], neutral: float) -> torch.Tensor | None:
            if all(v == neutral for v in values):
                return None
            return torch.tensor(values, dtype=torch.float32, device=device)

        top_k = [p.top_k if p.top_k > 0 else vocab_size for p in params]
        use_penalties = any(p.uses_penalties for p in params)
        seen_in_prompt = output_counts = None
        if use_penalties:
            seen_in_prompt = torch.zeros(len(rows), vocab_size, dtype=torch.bool, device=device)
            output_counts = torch.zeros(len(rows), vocab_size, dtype=torch.float32, device=device)
            for i, row in enumerate(rows):
                prompt = torch.tensor(row.prompt_token_ids, dtype=torch.int64, device=device)
                seen_in_prompt[i, prompt] = True
                if row.output_token_ids:
                    out = torch.tensor(row.output_token_ids, dtype=torch.int64, device=device)
                    output_counts[i].index_add_(0, out, torch.ones_like(out, dtype=torch.float32))
        banned_rows = [i for i, row in enumerate(rows) for _ in row.banned_token_ids]
        banned_ids = [t for row in rows for t in row.banned_token_ids]
        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        bias = [(i, t, v) for i, p in enumerate(params) for t, v in (p.logit_bias or {}).items()]
        penalty = column if use_penalties else (lambda values, neutral: None)
        return cls(
            temperature=torch.tensor(
                [p.temperature for p in params], dtype=torch.float32, device=device
            ),
            top_k=None
            if all(k == vocab_size for k in top_k)
            else torch.tensor(top_k, device=device),
            top_p=column([p.top_p for p in params], 1.0),
            min_p=column([p.min_p for p in params], 0.0),
            repetition_penalty=_as_col(penalty([p.repetition_penalty for p in params], 1.0)),
            frequency_penalty=_as_col(penalty([p.frequency_penalty for p in params], 0.0)),
            presence_penalty=_as_col(penalty([p.presence_penalty for p in params], 0.0)),
            seen_in_prompt=seen_in_prompt,
            output_counts=output_counts,
            banned=(
                (torch.tensor(banned_rows, device=device), torch.tensor(banned_ids, device=device))
                if banned_ids
                else None
            ),
            bias=_bias_tensors(bias, device) if bias else None,
            generators=tuple(row.generator for row in rows),
            num_logprobs=max(logprobs) if logprobs else None,
            all_greedy=all(p.is_greedy for p in params),
        )

    @property
    def argmax_only(self) -> bool:
        """Every row's token is the argmax of its raw logits: greedy, nothing banned or
        biased, no penalties, no logprobs."""
        return (
            self.all_greedy
            and self.banned is None
            and self.bias is None
            and self.output_counts is None
            and self.num_logprobs is None
        )


def _bias_tensors(
    entries: list[tuple[int, int, float]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, ids, values = zip(*entries, strict=True)
    return (
        torch.tensor(rows, device=device),
        torch.tensor(ids, device=device),
        torch.tensor(values, dtype=torch.float32, device=device),
    )


def _as_col(values: torch.Tensor | None) -> torch.Tensor | None:
    return None if values is None else values.unsqueeze(1)


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [rows] int64
    logprobs: torch.Tensor | None  # [rows] float32: the chosen token's logprob
    ranks: torch.Tensor | None  # [rows] int64: 1 = most likely
    top_ids: torch.Tensor | None  # [rows, num_logprobs]
    top_logprobs: torch.Tensor | None  # [rows, num_logprobs]


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """vLLM's penalties. Repetition: tokens seen in prompt or output have positive logits
    divided by, negative ones multiplied by, the penalty. Frequency: minus penalty × output
    count. Presence: minus penalty if the token appeared in the output."""
    if batch.output_counts is None or batch.seen_in_prompt is None:
        return logits
    counts = batch.output_counts
    if batch.repetition_penalty is not None:
        seen = batch.seen_in_prompt | (counts > 0)
        penalty = batch.repetition_penalty.expand_as(logits)
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalised, logits)
    if batch.frequency_penalty is not None:
        logits = logits - batch.frequency_penalty * counts
    if batch.presence_penalty is not None:
        logits = logits - batch.presence_penalty * (counts > 0).float()
    return logits


def apply_filters(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Mask (to -inf) tokens outside top-k, outside the top-p nucleus, or below min-p."""
    if batch.min_p is not None:
        probs = logits.softmax(dim=-1)
        threshold = batch.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if batch.top_k is None and batch.top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if batch.top_k is not None:
        ranks = torch.arange(logits.shape[-1], device=logits.device)
        remove |= ranks[None, :] >= batch.top_k[:, None]
    if batch.top_p is not None:
        probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # probability of strictly better tokens
        remove |= mass_before >= batch.top_p[:, None]
    remove[:, 0] = False  # the most likely token always survives
    return logits.scatter(1, order, sorted_logits.masked_fill(remove, float("-inf")))


def argmax(logits: torch.Tensor, kernels: CpuKernels | None = None) -> torch.Tensor:
    """Each row's first largest logit: our CPU kernel where `kernels` has it loaded for the
    dtype, else torch.max, whose indices are argmax's (the first of equal maxima) in under
    half its time on a CPU."""
    kernel = None if kernels is None else kernels.argmax(logits)
    return kernel(logits) if kernel is not None else logits.max(dim=-1).indices


class Sampler:
    """Draws from `generator` for rows without their own seed; every other input arrives in
    the `SamplingBatch`.

    Order of operations, per row: logit_bias, ban tokens (EOS before `min_tokens`), penalties
    (repetition, frequency, presence), temperature, then the top-k / top-p / min-p filters,
    then sampling (argmax for greedy rows). Logprobs, when asked, are of the raw model
    distribution (before any of that), as vLLM reports them. No Python loop over the
    vocabulary; the only per-row loop draws the noise of rows with their own seed, so a seeded
    request samples the same tokens in any batch.
    """

    def __init__(
        self, generator: torch.Generator | None = None, kernels: CpuKernels | None = None
    ) -> None:
        self.generator = generator
        self.kernels = kernels

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        # logits: [rows, vocab] in the LM head's dtype. A greedy batch takes their argmax as
        # they are (widening bf16 to float32 is exact, so its argmax is the same); every other
        # computes in float32.
        if batch.argmax_only:
            return SamplerOutput(
                token_ids=argmax(logits, self.kernels),
                logprobs=None,
                ranks=None,
                top_ids=None,
                top_logprobs=None,
            )
        logits = logits.float()
        raw_logprobs = logits.log_softmax(dim=-1) if batch.num_logprobs is not None else None
        if batch.bias is not None:
            rows, ids, values = batch.bias
            logits = logits.index_put((rows, ids), values, accumulate=True)
        if batch.banned is not None:
            logits = logits.index_put(
                batch.banned, torch.tensor(float("-inf"), device=logits.device)
            )
        logits = apply_penalties(logits, batch)
        greedy_ids = argmax(logits, self.kernels)
        if batch.all_greedy:
            token_ids = greedy_ids
        else:
            temperature = batch.temperature.clamp(min=1e-5).unsqueeze(1)
            probs = apply_filters(logits / temperature, batch).softmax(dim=-1)
            drawn = self._draw(probs, batch)
            token_ids = torch.where(batch.temperature == 0, greedy_ids, drawn)
        if raw_logprobs is None:
            return SamplerOutput(
                token_ids=token_ids, logprobs=None, ranks=None, top_ids=None, top_logprobs=None
            )
        assert batch.num_logprobs is not None
        chosen = raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
        ranks = (raw_logprobs > chosen.unsqueeze(1)).sum(dim=-1) + 1
        top_logprobs, top_ids = raw_logprobs.topk(batch.num_logprobs, dim=-1)
        return SamplerOutput(
            token_ids=token_ids,
            logprobs=chosen,
            ranks=ranks,
            top_ids=top_ids,
            top_logprobs=top_logprobs,
        )

    def _draw(self, probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Sample each row of `probs` by an exponential race: argmax(p / E), E ~ Exp(1)."""
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, generator in enumerate(batch.generators):
            if generator is not None:
                noise[row].exponential_(generator=generator)
        return (probs / noise).argmax(dim=-1)
