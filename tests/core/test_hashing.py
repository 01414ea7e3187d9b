"""Block hashing: byte-identical to vLLM's definitions (docs/behaviour.md §1)."""

from __future__ import annotations

import hashlib
import json
import logging
import pickle
import sys
from pathlib import Path
from typing import Any

import cbor2
import numpy as np
import pytest
import xxhash

from blockserve.core.hashing import (
    HASH_FUNCTIONS,
    BlockHasher,
    BlockKeyInputs,
    MultiModalFeature,
    RequestBlockHasher,
    block_hash_to_uint64,
    hash_block_tokens,
    resolve_seed,
    tier_key,
)
from blockserve.errors import InvalidConfigError, UnknownHashAlgorithmError
from blockserve.sched.request import Request
from tests.core.vllm_hash_vectors import jsonable

# Independent spellings of the four algorithms, straight from docs/behaviour.md item 3.
DEFINITIONS = {
    "sha256": lambda obj: hashlib.sha256(pickle.dumps(obj, protocol=5)).digest(),
    "sha256_cbor": lambda obj: hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest(),
    "xxhash": lambda obj: xxhash.xxh3_128_digest(pickle.dumps(obj, protocol=5)),
    "xxhash_cbor": lambda obj: xxhash.xxh3_128_digest(cbor2.dumps(obj, canonical=True)),
}

# sha256(pickle.dumps("vllm-none-hash", protocol=5)), and block 0 of tokens 0..15 on it.
SHA256_NONE_HASH_HEX = "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198"
SHA256_BLOCK0_HEX = "fe8fa5dda3210d0ca2031e37cbe3b001186773cd1c710beb2d45fcb51d434798"


@pytest.fixture(autouse=True)
def _no_hash_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)


def test_pickle_protocol_is_five() -> None:
    """vLLM pickles with HIGHEST_PROTOCOL, which is 5 on every supported Python."""
    assert pickle.HIGHEST_PROTOCOL == 5
    assert sys.version_info >= (3, 11)


def test_sha256_none_hash_default_seed() -> None:
    """With PYTHONHASHSEED unset, NONE_HASH = sha256(pickle("vllm-none-hash"))."""
    hasher = BlockHasher("sha256")
    assert hasher.none_hash == hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=5)).digest()
    assert hasher.none_hash.hex() == SHA256_NONE_HASH_HEX


def test_sha256_block_golden_value() -> None:
    """Block 0 of tokens 0..15 has a fixed digest and a fixed uint64 event form."""
    block_hash = BlockHasher("sha256").hash_block(None, range(16))
    assert block_hash.hex() == SHA256_BLOCK0_HEX
    assert block_hash_to_uint64(block_hash) == 3262291359910021016


def test_none_hash_from_pythonhashseed(monkeypatch: pytest.MonkeyPatch) -> None:
    """PYTHONHASHSEED=42 seeds NONE_HASH with the string "42", for every algorithm."""
    monkeypatch.setenv("PYTHONHASHSEED", "42")
    for algo, definition in DEFINITIONS.items():
        assert BlockHasher(algo).none_hash == definition("42")


def test_explicit_seed_overrides_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """An explicit seed wins over PYTHONHASHSEED."""
    monkeypatch.setenv("PYTHONHASHSEED", "42")
    assert BlockHasher("sha256", seed="7").none_hash == DEFINITIONS["sha256"]("7")


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_sha_algorithms_default_seed(algo: str) -> None:
    """Both sha256 algorithms fall back to the seed "vllm-none-hash"."""
    assert resolve_seed(algo, environ={}) == "vllm-none-hash"
    assert BlockHasher(algo).none_hash == DEFINITIONS[algo]("vllm-none-hash")


@pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor"])
def test_xxhash_without_seed_is_random_and_warns(
    algo: str, caplog: pytest.LogCaptureFixture
) -> None:
    """xxhash with PYTHONHASHSEED unset seeds randomly (per hasher/process) and warns."""
    with caplog.at_level(logging.WARNING, logger="blockserve.core.hashing"):
        first, second = BlockHasher(algo), BlockHasher(algo)
    assert first.none_hash != second.none_hash
    assert len(first.none_hash) == 16
    assert sum("PYTHONHASHSEED is not set" in r.message for r in caplog.records) == 2


@pytest.mark.parametrize("algo", sorted(DEFINITIONS))
def test_chain_of_blocks_matches_definition(algo: str) -> None:
    """A 3-block chain: each hash is H((parent, tuple(tokens), None)), block 0 on NONE_HASH."""
    hasher = BlockHasher(algo, seed="s")
    define = DEFINITIONS[algo]
    none_hash = define("s")
    tokens = list(range(100, 150))  # 3 full blocks of 16 and a partial one of 2
    h0 = define((none_hash, tuple(tokens[0:16]), None))
    h1 = define((h0, tuple(tokens[16:32]), None))
    h2 = define((h1, tuple(tokens[32:48]), None))
    assert hasher.hash_prompt(tokens) == [h0, h1, h2]
    assert len(h0) == (32 if algo.startswith("sha256") else 16)


def test_hash_block_tokens_takes_explicit_parent() -> None:
    """hash_block_tokens chains on the parent it is given and keeps extra keys as a tuple."""
    parent = b"\x01" * 32
    expected = DEFINITIONS["sha256"]((parent, (1, 2, 3), ("lora-a",)))
    assert hash_block_tokens(HASH_FUNCTIONS["sha256"], parent, [1, 2, 3], ("lora-a",)) == expected


def test_empty_extra_keys_hash_as_none() -> None:
    """An empty tuple of extra keys is never hashed: it means None."""
    fn = HASH_FUNCTIONS["sha256"]
    assert hash_block_tokens(fn, b"p", [1], ()) == hash_block_tokens(fn, b"p", [1], None)


def test_cache_salt_only_on_block_zero() -> None:
    """The salt, tagged, is an extra key of block 0 only; chaining changes every later hash."""
    hasher = BlockHasher("sha256")
    define = DEFINITIONS["sha256"]
    tokens = list(range(8))
    h0 = define((hasher.none_hash, (0, 1, 2, 3), (("cache_salt", "tenant-a"),)))
    h1 = define((h0, (4, 5, 6, 7), None))
    salted = hasher.hash_prompt(tokens, block_size=4, cache_salt="tenant-a")
    assert salted == [h0, h1]
    unsalted = hasher.hash_prompt(tokens, block_size=4)
    assert unsalted[0] != salted[0] and unsalted[1] != salted[1]


def test_lora_name_and_path_on_every_block() -> None:
    """The adapter's name and path, tagged "lora", are an extra key of every block."""
    hasher = BlockHasher("sha256")
    define = DEFINITIONS["sha256"]
    key = (("lora", "adapter", "/a"),)
    h0 = define((hasher.none_hash, (0, 1, 2, 3), key))
    h1 = define((h0, (4, 5, 6, 7), key))
    assert hasher.hash_prompt(range(8), block_size=4, lora=("adapter", "/a")) == [h0, h1]
    assert hasher.hash_prompt(range(8), block_size=4, lora=("adapter", "/b"))[0] != h0


def test_extra_key_order_lora_mm_salt_embeds() -> None:
    """Extra keys come tagged as (LoRA, multimodal items, salt, prompt-embedding digest); the
    events carry them untagged."""
    embeds = np.arange(8 * 2, dtype=np.float32).reshape(8, 2)
    keys = BlockKeyInputs(
        lora_name="adapter",
        lora_path="/a",
        mm_features=(MultiModalFeature("img-1", offset=2, length=3),),
        cache_salt="salt",
        prompt_embeds=embeds,
    )
    digest0 = hashlib.sha256(embeds[0:4].tobytes()).digest()
    digest1 = hashlib.sha256(embeds[4:8].tobytes()).digest()
    lora = ("lora", "adapter", "/a")
    assert keys.extra_keys(0, 4) == (
        lora, ("mm", "img-1", 2), ("cache_salt", "salt"), ("prompt_embeds", digest0)
    )  # fmt: skip
    # The image spans tokens 2..4, so it overlaps block 1 too, at offset -2; no salt there.
    assert keys.extra_keys(4, 8) == (lora, ("mm", "img-1", -2), ("prompt_embeds", digest1))
    empty = hashlib.sha256(b"").digest()
    assert keys.extra_keys(8, 12) == (lora, ("prompt_embeds", empty))
    assert keys.event_extra_keys(0, 3, 4) == [
        ("adapter", ("img-1", 2), "salt", digest0),
        ("adapter", ("img-1", -2), digest1),
        ("adapter", empty),
    ]


def _ours(case: dict[str, Any], algo: str, num_tokens: int, block_size: int) -> dict[str, Any]:
    """Our block hashes and event extra keys for a case of vllm_hash_vectors.json."""
    embeds = None
    if case.get("embeds"):
        embeds = np.arange(num_tokens * 4, dtype=np.float32).reshape(num_tokens, 4)
    lora = case.get("lora")
    keys = BlockKeyInputs(
        lora_name=None if lora is None else lora[0],
        lora_path="" if lora is None else lora[1],
        mm_features=tuple(MultiModalFeature(*item) for item in case.get("mm", [])),
        cache_salt=case.get("cache_salt"),
        prompt_embeds=embeds,
    )
    tokens = list(range(100, 100 + num_tokens))
    hashes = BlockHasher(algo).hash_new_blocks(tokens, [], block_size, keys)
    events = keys.event_extra_keys(0, len(hashes), block_size)

    return {"block_hashes": [h.hex() for h in hashes], "event_extra_keys": jsonable(events)}


VECTORS = json.loads((Path(__file__).parent / "vllm_hash_vectors.json").read_text())


@pytest.mark.parametrize(
    "case", VECTORS["cases"], ids=[f"{c['name']}-{c['algo']}" for c in VECTORS["cases"]]
)
def test_hashes_and_event_keys_equal_vllms(case: dict[str, Any]) -> None:
    """Every combination of extra keys (salt, LoRA, both, images, all three, embeddings), as
    vLLM 0.32's own code hashes and publishes them (tests/core/vllm_hash_vectors.py)."""
    assert VECTORS["vllm_version"] == "0.32.0"
    ours = _ours(case, case["algo"], VECTORS["num_tokens"], VECTORS["block_size"])
    assert ours == {k: case[k] for k in ("block_hashes", "event_extra_keys")}


def test_no_extra_keys_is_none() -> None:
    """A request with no LoRA, media, salt or embeddings hashes its blocks with None."""
    assert BlockKeyInputs().extra_keys(0, 16) is None
    assert BlockKeyInputs(cache_salt="s").extra_keys(16, 32) is None


def test_request_hashes_only_new_full_blocks() -> None:
    """Appending output tokens hashes exactly the blocks they complete, with prompt chaining."""
    hasher = BlockHasher("sha256")
    request = Request("r", list(range(6)), block_hasher=RequestBlockHasher(hasher, 4))
    assert len(request.block_hashes) == 1  # 6 tokens: one full block, a partial one unhashed
    first = request.block_hashes[0]
    request.append_output_token_ids(100)
    assert len(request.block_hashes) == 1
    request.append_output_token_ids(101)  # token 8 of 8: block 1 completes
    assert len(request.block_hashes) == 2
    assert request.block_hashes[0] is first  # earlier hashes are never recomputed
    request.append_output_token_ids([102, 103, 104, 105, 106])
    assert request.block_hashes == hasher.hash_prompt(
        [0, 1, 2, 3, 4, 5, 100, 101, 102, 103, 104, 105, 106], block_size=4
    )
    assert len(request.block_hashes) == 3


def test_unknown_algorithm_is_rejected() -> None:
    """An unknown algorithm name raises a typed error naming the choices."""
    with pytest.raises(UnknownHashAlgorithmError, match="sha256, sha256_cbor, xxhash"):
        BlockHasher("md5")


@pytest.mark.parametrize("block_size", [0, -16, 1.5, True])
def test_bad_block_size_is_rejected(block_size: object) -> None:
    """A block size that is not a positive integer raises InvalidConfigError."""
    with pytest.raises(InvalidConfigError, match="block_size"):
        BlockHasher().hash_prompt(range(32), block_size=block_size)  # type: ignore[arg-type]


def test_partial_prompt_has_no_hash() -> None:
    """Only full blocks are hashed: 15 tokens give no hash, 16 give one."""
    hasher = BlockHasher()
    assert hasher.hash_prompt(range(15)) == []
    assert len(hasher.hash_prompt(range(16))) == 1


def test_a_tier_key_is_the_hash_or_a_digest_of_it_and_the_adapter() -> None:
    """Without an adapter a block's tier key is its hash; with one, 32 bytes that differ per
    adapter content and from the hash."""
    block_hash = BlockHasher("sha256").hash_block(None, range(16))
    assert tier_key(block_hash, None) is block_hash
    one, two = tier_key(block_hash, b"\x01" * 16), tier_key(block_hash, b"\x02" * 16)
    assert len({block_hash, one, two}) == 3 and len(one) == 32
    assert one == hashlib.sha256(block_hash + b"\x01" * 16).digest()
