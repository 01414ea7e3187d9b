"""Mooncake-format traces and the request model the replayer gives them. One JSON object per line:
`timestamp` (ms), `input_length`, `output_length`, `hash_ids` (one id per `block_size`-token
prompt block, the last possibly partial; equal ids at one position mean an identical prefix up to
and including that block), and ours, optional: `lora_name`, whose blocks no other adapter shares."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from blockserve.core.hashing import BlockHash
from blockserve.errors import InvalidRequestError


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """Each request becomes, in blocks of `block_size` tokens:

        | full prompt blocks (trace ids) | partial prompt + output ... | (only full blocks count)
        |<--- input_length // B ------->|<- full blocks up to (input + output) // B: unique ids ->|

    Only full blocks are ever cached, as in the engine; the blocks holding output tokens get ids
    no other request shares. A lookup may hit at most `(input_length - 1) // B` blocks: the last
    prompt token is always computed.
    """

    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    lora_name: str | None = None  # the adapter: a key of every block hash, as in the engine


def load_trace(path: str | Path) -> list[TraceRequest]:
    """Read a Mooncake-format JSONL trace; an unreadable file or a malformed line is an
    InvalidRequestError (one line, no traceback, at the CLI)."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise InvalidRequestError(f"cannot read the trace {path}: {reason}") from None
    requests = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            request = TraceRequest(
                timestamp=float(row["timestamp"]),
                input_length=int(row["input_length"]),
                output_length=int(row["output_length"]),
                hash_ids=tuple(int(h) for h in row["hash_ids"]),
                lora_name=None if row.get("lora_name") is None else str(row["lora_name"]),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidRequestError(f"{path}:{number}: not a trace record ({exc})") from None
        if request.input_length < 1 or request.output_length < 0:
            raise InvalidRequestError(f"{path}:{number}: lengths out of range")
        requests.append(request)
    return requests


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """One request in blocks: the hashes of its full blocks and how many may be hits."""

    block_hashes: tuple[BlockHash, ...]  # prompt blocks first, then unique output blocks
    num_prompt_blocks: int  # full prompt blocks: those a later request can share
    num_hittable_blocks: int  # (input_length - 1) // block_size
    num_blocks: int  # blocks held while the request runs (partial last block included)


def block_layouts(trace: Iterable[TraceRequest], block_size: int) -> list[BlockLayout]:
    layouts = []
    for index, request in enumerate(trace):
        num_prompt = request.input_length // block_size
        if len(request.hash_ids) < num_prompt:
            raise InvalidRequestError(
                f"request {index}: {len(request.hash_ids)} hash ids for {num_prompt} full blocks "
                f"of {block_size} tokens (is --trace-block-size right?)"
            )
        total = request.input_length + request.output_length
        prompt = [_prompt_hash(h, request.lora_name) for h in request.hash_ids[:num_prompt]]
        outputs = [
            BlockHash(b"o" + index.to_bytes(4, "big") + i.to_bytes(4, "big"))
            for i in range(num_prompt, total // block_size)
        ]
        layouts.append(
            BlockLayout(
                block_hashes=tuple(prompt + outputs),
                num_prompt_blocks=num_prompt,
                num_hittable_blocks=(request.input_length - 1) // block_size,
                num_blocks=-(-total // block_size),
            )
        )
    return layouts


def _prompt_hash(hash_id: int, lora_name: str | None) -> BlockHash:
    """A prompt block's key; under an adapter a digest of its name and the id, so that the
    event form (the last 8 bytes) differs too, as the engine's extra key makes it differ."""
    id_bytes = hash_id.to_bytes(8, "big", signed=True)
    if lora_name is None:
        return BlockHash(b"p" + id_bytes)
    name = lora_name.encode()
    return BlockHash(b"p" + name + hashlib.blake2b(name + b"\0" + id_bytes, digest_size=8).digest())
