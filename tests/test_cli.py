"""The `blockserve` command line: vLLM's flag names and defaults (docs/behaviour.md §8)."""

from __future__ import annotations

import pytest

from blockserve.cli import build_parser, main


def test_serve_defaults() -> None:
    """`blockserve serve` with no flags: embedded model, 127.0.0.1:8000, prefix caching on."""
    args = build_parser().parse_args(["serve"])
    assert args.model is None
    assert (args.host, args.port) == ("127.0.0.1", 8000)
    assert args.enable_prefix_caching is True
    assert (args.block_size, args.prefix_caching_hash_algo) == (16, "sha256")
    assert (args.scheduling_policy, args.seed, args.dtype) == ("fcfs", 0, "auto")


def test_prefix_caching_can_be_disabled() -> None:
    """--no-enable-prefix-caching turns the prefix cache off."""
    args = build_parser().parse_args(["serve", "--no-enable-prefix-caching"])
    assert args.enable_prefix_caching is False


def test_cache_size_flags_are_exclusive(capsys: pytest.CaptureFixture[str]) -> None:
    """--kv-cache-memory-bytes and --num-gpu-blocks-override cannot both be given."""
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(
            ["serve", "--kv-cache-memory-bytes", "1000", "--num-gpu-blocks-override", "10"]
        )
    assert exc.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_unknown_hash_algo_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """The hash algorithm must be one of the four."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--prefix-caching-hash-algo", "md5"])
    assert "invalid choice: 'md5'" in capsys.readouterr().err


def test_the_model_may_be_positional_as_in_vllm() -> None:
    """`blockserve serve MODEL` is `--model MODEL`; list flags take one or more values."""
    flags = ["--served-model-name", "a", "b", "--api-key", "k1", "--api-key", "k2"]
    args = build_parser().parse_args(["serve", "/models/m", *flags])
    assert (args.model_tag, args.model) == ("/models/m", None)
    assert (args.served_model_name, args.api_key) == (["a", "b"], ["k1", "k2"])


def test_two_different_models_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """A positional model and a different --model: exit 2 with one line naming both."""
    assert main(["serve", "/models/a", "--model", "/models/b"]) == 2
    assert capsys.readouterr().err == (
        "blockserve serve: two models given: '/models/a' (positional) and '/models/b' (--model)\n"
    )
