"""Backend choice: automatic by device, overridable, with a clear error when it cannot run."""

from __future__ import annotations

import pytest

from blockserve.attention.selector import get_attention_backend
from blockserve.attention.torch_backend import TorchAttentionBackend
from blockserve.cli import main
from blockserve.errors import BackendUnavailableError, InvalidConfigError


def test_auto_is_torch_on_the_cpu() -> None:
    """On the CPU, auto picks the torch backend."""
    assert isinstance(get_attention_backend("auto", "cpu"), TorchAttentionBackend)


def test_gpu_backends_refuse_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """triton (outside the interpreter) and cuda say why they cannot run on the CPU."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(BackendUnavailableError, match="needs a CUDA device"):
        get_attention_backend("triton", "cpu")
    with pytest.raises(BackendUnavailableError, match="cuda attention backend needs a CUDA device"):
        get_attention_backend("cuda", "cpu")
    with pytest.raises(InvalidConfigError, match="unknown attention backend"):
        get_attention_backend("flash", "cpu")


def test_serve_with_an_unavailable_backend_exits_cleanly(
    capsys: pytest.CaptureFixture[str], tiny_llama_dir: object
) -> None:
    """`blockserve serve --attention-backend cuda` on the CPU prints the reason, exits 2."""
    code = main(
        ["serve", "--model", str(tiny_llama_dir), "--attention-backend", "cuda", "--device", "cpu"]
    )
    assert code == 2
    assert "cuda attention backend needs a CUDA device" in capsys.readouterr().err
