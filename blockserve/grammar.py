"""Structured outputs through llguidance: a constraint checked once, a matcher per sample."""

from __future__ import annotations

import concurrent.futures
import copy
import json
import queue
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import llguidance
import torch

from blockserve.errors import InvalidRequestError
from blockserve.grammar_limits import ConstraintLimits
from blockserve.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of its type stubs only

# The field a request names its constraint in, for the 400 that refuses it.
_FIELD = "structured_outputs"
_WHITESPACE = r"[\x20\x0A\x0D\x09]"
_SOURCE_ECHO = re.compile(r"^[0-9]+ \|")
# The compiler recurses once per rule it follows, a few KB a level: the limits' 1,000 rules
# need a few MB, and a fault past that would take the process down.
_WORKER_STACK_BYTES = 64 << 20
_NUM_WORKERS = 2
_KEPT_MATCHERS = 256
T = TypeVar("T")


class GrammarCompiler:
    """Builds constraints for one tokenizer; thread-safe, with the vocabulary scan (~0.3 s)
    done on first use, so only servers that see a constrained request pay it.

    `GrammarCompiler` turns a request's `StructuredOutputsParams` into an llguidance matcher and
    refuses, naming the field, a constraint over its limits (grammar_limits.py) or one that does
    not compile, panics the library or fails its first mask. The input processor calls it on a
    tokenizer thread; the compile itself runs on a worker thread with a large stack and a time
    limit, so a bad constraint is a 400 before the request is queued. The compiled matcher is
    kept (the latest 256), and the model runner copies it for each sample when it first runs:
    the engine thread compiles only a constraint that has left that cache (within the same
    limits).

    Each step, `apply_token_masks` asks the matchers of the constrained rows for their
    next-token bitmask and masks those rows' logits to -inf in place; rows without a constraint
    are not touched, and a batch without one costs a single check. After sampling, each matcher
    consumes its token.

    llguidance over xgrammar (what vLLM uses by default): xgrammar 0.2.9 computes masks faster,
    but a string with `maxLength` or `minLength` lets it emit raw control characters (which no
    strict JSON parser takes) and no escapes at all (its open issue #800); llguidance keeps such
    strings valid JSON (docs/benchmarks/features.md has both measured).

    The grammar's end is any of the model's EOS tokens: when the constraint is satisfied the
    mask leaves only those, and the scheduler stops the sample as for any EOS.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        max_whitespace: int = 16,
        limits: ConstraintLimits | None = None,
    ) -> None:
        self._text_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self.limits = limits or ConstraintLimits()
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._workers: CompileWorkers | None = None
        self._compiled: OrderedDict[StructuredOutputsParams, llguidance.LLMatcher] = OrderedDict()
        # Whitespace allowed between two JSON tokens: -1 any, 0 none but one space after each
        # comma and colon (JSON as json.dumps prints it).
        # Unbounded, a small model can spend all of max_tokens on whitespace.
        self._json_options: JsonCompileOptions = {"whitespace_flexible": max_whitespace != 0}
        if max_whitespace == 0:
            self._json_options["item_separator"] = ", "
            self._json_options["key_separator"] = ": "
        if max_whitespace > 0:
            self._json_options["whitespace_pattern"] = f"{_WHITESPACE}{{1,{max_whitespace}}}"

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(
                    _backend_json(self._text_tokenizer),
                    n_vocab=self.vocab_size,
                    eos_token=self._eos_token_ids,
                )
            return self._tokenizer

    def compile(self, params: StructuredOutputsParams) -> None:
        """Check and compile the constraint on a worker; InvalidRequestError naming the field
        if it is over a limit, does not compile in time, or fails."""
        self.limits.check(params)
        with self._lock:
            if self._workers is None:
                self._workers = CompileWorkers(_NUM_WORKERS, _WORKER_STACK_BYTES)
            workers = self._workers
        kind = params.kind
        try:
            matcher = workers.run(lambda: self._build(params), self.limits.compile_timeout_s)
        except InvalidRequestError:
            raise
        except TimeoutError:
            raise InvalidRequestError(
                f"the {kind} constraint did not compile within "
                f"{self.limits.compile_timeout_s:g} s (--structured-outputs-compile-timeout)",
                _FIELD,
            ) from None
        except BaseException as exc:  # llguidance's panics derive from BaseException
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            raise InvalidRequestError(
                f"the {kind} constraint does not compile: {_one_line(exc)}", _FIELD
            ) from None
        with self._lock:
            self._compiled[params] = matcher
            self._compiled.move_to_end(params)
            while len(self._compiled) > _KEPT_MATCHERS:
                self._compiled.popitem(last=False)

    def _build(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A matcher at the constraint's start whose first mask computed: the grammar's
        lexer and parser limits show there, not in the middle of a run."""
        matcher = llguidance.LLMatcher(self.tokenizer, self._grammar(params), log_level=0)
        if not matcher.is_error():
            matcher.deep_copy().compute_bitmask()
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def _grammar(self, params: StructuredOutputsParams) -> str:
        if params.json is not None:
            schema = _schema(params.json)
            return llguidance.LLMatcher.grammar_from_json_schema(
                schema, defaults=self._json_options
            )
        if params.json_object:
            # An object, as OpenAI's json_object promises (not any JSON value).
            return llguidance.LLMatcher.grammar_from_json_schema(
                {"type": "object"}, defaults=self._json_options
            )
        if params.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(params.regex)
        if params.choice is not None:
            # Lark string literals take JSON's escapes.
            return "start: " + " | ".join(json.dumps(c) for c in params.choice)
        assert params.grammar is not None
        # GBNF (llama.cpp's and vLLM's EBNF) or Lark: llguidance tells them apart.
        return llguidance.grammar_from("grammar", params.grammar)

    def matcher(
        self, params: StructuredOutputsParams, output_token_ids: Sequence[int] = ()
    ) -> llguidance.LLMatcher:
        """A matcher for one sample, advanced over the tokens it already generated (a sample
        resumed after preemption): a copy of the one `compile` kept, or, for a constraint
        that has left that cache, compiled here (it passed the limits when it came in). A
        matcher that fails raises."""
        with self._lock:
            template = self._compiled.get(params)
        try:
            matcher = template.deep_copy() if template is not None else self._build(params)
        except ValueError as exc:
            raise RuntimeError(f"the constraint does not compile: {_one_line(exc)}") from None
        for token_id in output_token_ids:
            if not matcher.consume_token(token_id):
                raise RuntimeError(f"token {token_id} breaks the sample's own constraint")
        return matcher


class CompileWorkers:
    """Threads with a large stack that run compiles; the caller waits at most its time limit
    (a compile past it runs on, holding its thread: the limits keep that short)."""

    def __init__(self, num_threads: int, stack_bytes: int) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future]] = (
            queue.SimpleQueue()
        )
        previous = threading.stack_size(stack_bytes)  # for the threads started here only
        try:
            for index in range(num_threads):
                name = f"blockserve-grammar-{index}"
                threading.Thread(target=self._serve, name=name, daemon=True).start()
        finally:
            threading.stack_size(previous)

    def run(self, fn: Callable[[], T], timeout_s: float) -> T:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._queue.put((fn, future))
        return future.result(timeout=timeout_s)

    def _serve(self) -> None:
        while True:
            fn, future = self._queue.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # a library panic too: it fails this compile only
                future.set_exception(exc)


def _schema(text: str) -> dict[str, Any]:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"the JSON schema is not valid JSON: {exc}", _FIELD) from None
    if not isinstance(schema, dict):
        raise InvalidRequestError("the JSON schema must be an object", _FIELD)
    return schema


def _backend_json(tokenizer: Any) -> str:
    """The `tokenizers` JSON of a tokenizer with a `backend_tokenizer` (ours or a transformers
    fast one), without padding or truncation, which would change what the grammar sees."""
    backend = tokenizer.backend_tokenizer
    if backend.padding is not None or backend.truncation is not None:
        backend = copy.copy(backend)  # the caller's stays as it is
        backend.no_padding()
        backend.no_truncation()
    return str(backend.to_str())


def _one_line(error: object) -> str:
    """llguidance's message on one line, without its caret lines and source echoes."""
    lines = [line.strip() for line in str(error).splitlines()]
    kept = [line for line in lines if line.strip("^ ") and not _SOURCE_ECHO.match(line)]
    return " ".join(kept)[:400] or type(error).__name__


def apply_token_masks(
    logits: torch.Tensor, matchers: Sequence[llguidance.LLMatcher | None]
) -> dict[int, str]:
    """Mask, in place, each constrained row's logits to the tokens its matcher allows next.
    Returns {row: error} for rows whose matcher failed (their logits are left as they were)."""
    if all(m is None for m in matchers):
        return {}
    # llguidance's layout: bit t of row r is token t allowed; all allowed until filled. (Not
    # llguidance.torch: importing it costs 2.6 s of torch.compile machinery at start-up.)
    words = (logits.shape[-1] + 31) // 32
    bitmask = torch.full((len(matchers), words), -1, dtype=torch.int32)
    masked: list[int] = []
    failed: dict[int, str] = {}
    for row, matcher in enumerate(matchers):
        if matcher is None:
            continue
        if matcher.is_error():
            failed[row] = f"the grammar matcher failed: {_one_line(matcher.get_error())}"
            continue
        matcher.unsafe_compute_mask_ptr(bitmask[row].data_ptr(), words * 4)
        masked.append(row)
    if masked:
        mask_rows(logits, bitmask.to(logits.device, non_blocking=True), masked)
    return failed


_BIT = torch.arange(32, dtype=torch.int32)


def mask_rows(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """`logits[rows]` to -inf where the bitmask (token t is bit t % 32 of word t // 32, the
    layout llguidance and xgrammar share) has a 0. Unpacked with tensor ops, every row at
    once (docs/benchmarks/features.md compares it with xgrammar's kernel)."""
    index = torch.tensor(rows, device=logits.device)
    words = bitmask.index_select(0, index)
    bits = _BIT.to(logits.device)
    allowed = ((words.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, : logits.shape[-1]]
    logits[index] = logits.index_select(0, index).masked_fill_(~allowed, float("-inf"))
