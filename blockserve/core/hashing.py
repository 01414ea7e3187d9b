"""Chained block hashing, byte-identical to vLLM's prefix-cache keys. Owns the four hash algorithms,
NONE_HASH seeding, the extra keys of a block (LoRA name, multimodal items, cache salt, prompt
embeddings) and the incremental hasher that a request uses as its tokens complete blocks. Holds
no module-level mutable state: the seed lives in a `BlockHasher` instance. Must not import torch."""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, NewType

import cbor2
import xxhash

from blockserve.errors import InvalidConfigError, UnknownHashAlgorithmError

logger = logging.getLogger(__name__)

BlockHash = NewType("BlockHash", bytes)
"""The raw digest of one full block: 32 bytes for sha256*, 16 bytes for xxhash*."""

HashFn = Callable[[Any], bytes]

DEFAULT_SEED = "vllm-none-hash"
"""The NONE_HASH seed of the sha256 algorithms when PYTHONHASHSEED is unset (vLLM's value)."""

_PICKLE_PROTOCOL = pickle.HIGHEST_PROTOCOL  # 5 on every supported Python


def sha256(obj: Any) -> bytes:
    """SHA-256 of the object's pickle (protocol 5): vLLM's default `sha256`."""
    return hashlib.sha256(pickle.dumps(obj, protocol=_PICKLE_PROTOCOL)).digest()


def sha256_cbor(obj: Any) -> bytes:
    """SHA-256 of the object's canonical CBOR: reproducible from any language."""
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def xxhash_pickle(obj: Any) -> bytes:
    """xxh3-128 of the object's pickle: vLLM's `xxhash`."""
    return xxhash.xxh3_128_digest(pickle.dumps(obj, protocol=_PICKLE_PROTOCOL))


def xxhash_cbor(obj: Any) -> bytes:
    """xxh3-128 of the object's canonical CBOR: vLLM's `xxhash_cbor`."""
    return xxhash.xxh3_128_digest(cbor2.dumps(obj, canonical=True))


HASH_FUNCTIONS: Mapping[str, HashFn] = MappingProxyType(
    {
        "sha256": sha256,
        "sha256_cbor": sha256_cbor,
        "xxhash": xxhash_pickle,
        "xxhash_cbor": xxhash_cbor,
    }
)
"""The algorithms of `--prefix-caching-hash-algo`, by name (read-only)."""


def get_hash_fn(algo: str) -> HashFn:
    """The hash function named `algo`; `UnknownHashAlgorithmError` for any other name."""
    try:
        return HASH_FUNCTIONS[algo]
    except KeyError:
        raise UnknownHashAlgorithmError(
            f"unknown prefix-caching hash algorithm {algo!r}; "
            f"choose one of {', '.join(HASH_FUNCTIONS)}"
        ) from None


def resolve_seed(algo: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The NONE_HASH seed for `algo`: PYTHONHASHSEED when set, else vLLM's default.

    The sha256 algorithms fall back to the fixed string "vllm-none-hash", so every process
    agrees. The xxhash algorithms fall back to None, meaning a random per-process seed: hashes
    then differ between processes, so a warning is logged.
    """
    get_hash_fn(algo)  # validate the name before anything else
    env = os.environ if environ is None else environ
    seed = env.get("PYTHONHASHSEED")
    if seed is not None:
        return seed
    if algo.startswith("sha256"):
        return DEFAULT_SEED
    logger.warning(
        "PYTHONHASHSEED is not set: %s block hashes use a random seed and will differ "
        "between processes (set PYTHONHASHSEED to share a prefix cache index).",
        algo,
    )
    return None


def hash_block_tokens(
    hash_fn: HashFn,
    parent: bytes,
    token_ids: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
) -> BlockHash:
    """Hash one full block chained on `parent` (the previous block's hash, or NONE_HASH).

    `extra_keys` is a non-empty tuple or None; an empty tuple would hash differently from
    vLLM, so it is normalised to None.
    """
    return BlockHash(hash_fn((parent, tuple(token_ids), extra_keys or None)))


def tier_key(block_hash: BlockHash, identity: bytes | None) -> BlockHash:
    """A block's key in the tiers below the device: its hash, or for a block computed under
    an adapter, a digest of the hash and the adapter's content (`identity`). vLLM's hash
    keys an adapter by name and path only, which a store every replica shares, or one kept
    across restarts, would serve for other weights found under that name and path."""
    if identity is None:
        return block_hash
    return BlockHash(hashlib.sha256(block_hash + identity).digest()[: len(block_hash)])


def block_hash_to_uint64(block_hash: bytes) -> int:
    """The event form of a hash: its last 8 bytes read as a big-endian unsigned int."""
    return int.from_bytes(block_hash[-8:], "big")


@dataclass(frozen=True, slots=True)
class MultiModalFeature:
    """One multimodal item placed in the prompt: its content hash and token span."""

    identifier: str
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class BlockKeyInputs:
    """Everything besides token ids that enters a request's block hashes.

    Extra keys of the block [start, end), each tagged with its source, in vLLM 0.32's order
    (`generate_block_hash_extra_keys`):
    1. `("lora", name, path)` on every block: the path too, so a name pointed at other weights
       never reads blocks computed with the old ones;
    2. `("mm", identifier, offset - start)` for each multimodal item overlapping the block;
    3. `("cache_salt", salt)` on block 0 only (hashes chain, so it changes every later hash);
    4. `("prompt_embeds", SHA-256 of the block's slice)` of the prompt embeddings (any
       buffer-protocol array).
    """

    lora_name: str | None = None
    lora_path: str = ""
    mm_features: tuple[MultiModalFeature, ...] = ()
    cache_salt: str | None = None
    prompt_embeds: Any = None

    @property
    def is_empty(self) -> bool:
        return (
            self.lora_name is None
            and not self.mm_features
            and not self.cache_salt
            and self.prompt_embeds is None
        )

    def extra_keys(self, start: int, end: int) -> tuple[Any, ...] | None:
        """The tagged extra keys of the block covering token positions [start, end), or None."""
        keys: list[Any] = []
        if self.lora_name is not None:
            keys.append(("lora", self.lora_name, self.lora_path))
        for feature in self.mm_features:
            if feature.offset < end and feature.offset + feature.length > start:
                keys.append(("mm", feature.identifier, feature.offset - start))
        if start == 0 and self.cache_salt:
            keys.append(("cache_salt", self.cache_salt))
        if self.prompt_embeds is not None:
            embeds_slice = memoryview(self.prompt_embeds[start:end]).tobytes()
            keys.append(("prompt_embeds", hashlib.sha256(embeds_slice).digest()))
        return tuple(keys) if keys else None

    def event_extra_keys(
        self, first_block: int, end_block: int, block_size: int
    ) -> list[tuple[Any, ...] | None]:
        """`BlockStored.extra_keys` of blocks [first_block, end_block): one entry a block, the
        keys untagged as vLLM publishes them (`to_event_extra_keys`): the LoRA name, the
        `(identifier, offset)` pairs, the salt, the embeddings' digest."""
        if self.is_empty:
            return [None] * (end_block - first_block)
        return [
            untag_extra_keys(self.extra_keys(i * block_size, (i + 1) * block_size))
            for i in range(first_block, end_block)
        ]


def untag_extra_keys(keys: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
    """One block's keys as KV events carry them: each tag dropped, an item's pair kept whole,
    every other key reduced to its first value (a LoRA key to its name)."""
    if keys is None:
        return None
    return tuple(key[1:] if key[0] == "mm" else key[1] for key in keys)


NO_EXTRA_KEYS = BlockKeyInputs()


class BlockHasher:
    """Computes vLLM-identical block hashes for one algorithm and seed.

    `seed=None` resolves as vLLM does (see `resolve_seed`). The instance is immutable after
    construction, so one hasher can be shared by the engine and by routers that hash prompts.

        block i hash = H((parent, tuple(token_ids[B*i : B*(i+1)]), extra_keys_or_None))
        parent       = hash of block i-1, or NONE_HASH = H(seed) for block 0
    """

    __slots__ = ("algo", "hash_fn", "none_hash", "random_seed")

    def __init__(self, algo: str = "sha256", seed: str | None = None) -> None:
        self.algo = algo
        self.hash_fn = get_hash_fn(algo)
        if seed is None:
            seed = resolve_seed(algo)
        # A per-process seed: no other process (nor this one after a restart) shares a hash.
        self.random_seed = seed is None
        if seed is None:
            seed = os.urandom(32).hex()
        self.none_hash = BlockHash(self.hash_fn(seed))

    def __repr__(self) -> str:
        return f"BlockHasher(algo={self.algo!r}, none_hash={self.none_hash.hex()[:16]}…)"

    def hash_block(
        self,
        parent: bytes | None,
        token_ids: Sequence[int],
        extra_keys: tuple[Any, ...] | None = None,
    ) -> BlockHash:
        """Hash one block; `parent=None` means block 0 (chained on NONE_HASH)."""
        return hash_block_tokens(
            self.hash_fn, self.none_hash if parent is None else parent, token_ids, extra_keys
        )

    def hash_new_blocks(
        self,
        token_ids: Sequence[int],
        block_hashes: Sequence[BlockHash],
        block_size: int,
        keys: BlockKeyInputs = NO_EXTRA_KEYS,
    ) -> list[BlockHash]:
        """Hashes of the full blocks of `token_ids` not yet in `block_hashes`.

        `block_hashes` are the hashes already computed for this token sequence (a prefix of
        its full blocks); only blocks completed since are hashed, so a request calls this each
        time tokens are appended. A trailing partial block is never hashed.
        """
        start = len(block_hashes) * block_size
        end = start + block_size
        num_tokens = len(token_ids)
        if end > num_tokens:
            return []
        hash_fn = self.hash_fn
        parent = block_hashes[-1] if block_hashes else self.none_hash
        new_hashes: list[BlockHash] = []
        if keys.is_empty:
            # Hot path: no extra keys, so the tuple layout is fixed.
            while end <= num_tokens:
                parent = BlockHash(hash_fn((parent, tuple(token_ids[start:end]), None)))
                new_hashes.append(parent)
                start, end = end, end + block_size
            return new_hashes
        while end <= num_tokens:
            extra = keys.extra_keys(start, end)
            parent = BlockHash(hash_fn((parent, tuple(token_ids[start:end]), extra)))
            new_hashes.append(parent)
            start, end = end, end + block_size
        return new_hashes

    def hash_prompt(
        self,
        token_ids: Sequence[int],
        block_size: int = 16,
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
        mm_features: Sequence[MultiModalFeature] = (),
    ) -> list[BlockHash]:
        """One hash per full block of a prompt: what a router needs to look a prompt up.
        `lora`: the adapter's (name, path), as the engines serving it were given them;
        `mm_features`: its images, each (identifier, offset, length)."""
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
            raise InvalidConfigError(f"block_size must be a positive integer, got {block_size!r}")
        keys = BlockKeyInputs(
            lora_name=None if lora is None else lora[0],
            lora_path="" if lora is None else lora[1],
            cache_salt=cache_salt,
            mm_features=tuple(mm_features),
        )
        return self.hash_new_blocks(token_ids, [], block_size, keys)


@dataclass(frozen=True, slots=True)
class RequestBlockHasher:
    """A `BlockHasher` bound to a block size: what each request calls as its tokens grow."""

    hasher: BlockHasher
    block_size: int

    def __call__(
        self,
        token_ids: Sequence[int],
        block_hashes: Sequence[BlockHash],
        keys: BlockKeyInputs = NO_EXTRA_KEYS,
    ) -> list[BlockHash]:
        """Hashes of the full blocks of `token_ids` beyond `block_hashes`."""
        return self.hasher.hash_new_blocks(token_ids, block_hashes, self.block_size, keys)
