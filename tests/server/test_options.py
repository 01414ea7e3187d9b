"""ServerConfig validates its options on construction."""

from __future__ import annotations

import pytest

from blockserve.errors import InvalidConfigError
from blockserve.server.options import ServerConfig, with_vllm_environment


def test_server_defaults() -> None:
    """127.0.0.1:8000, the model's own name, no API key, no open metrics or debug routes."""
    config = ServerConfig()
    assert (config.host, config.port, config.served_model_name, config.api_key) == (
        "127.0.0.1",
        8000,
        (),
        (),
    )
    assert not (config.metrics_without_auth or config.enable_debug_endpoints)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"port": 70000}, "port (--port) must be in 0..65535, got 70000"),
        ({"port": "80"}, "port (--port) must be of type int, got '80'"),
        ({"api_key": ("",)}, "api_key (--api-key) must be a tuple of non-empty strings, got ('',)"),
        ({"api_key": "k"}, "api_key (--api-key) must be a tuple of non-empty strings, got 'k'"),
        (
            {"tool_call_parser": "mistral"},
            "tool_call_parser (--tool-call-parser) must be one of hermes, got 'mistral'",
        ),
        (
            {"enable_auto_tool_choice": True},
            "enable_auto_tool_choice (--enable-auto-tool-choice) needs --tool-call-parser",
        ),
    ],
)
def test_bad_server_options_raise(kwargs: dict[str, object], message: str) -> None:
    """A bad option raises InvalidConfigError naming the field and its flag."""
    with pytest.raises(InvalidConfigError) as refused:
        ServerConfig(**kwargs)  # type: ignore[arg-type]
    assert str(refused.value) == message


@pytest.mark.parametrize(
    ("value", "routes"),
    [("1", True), ("True", True), (" true ", True), ("0", False), ("yes", False), (None, False)],
)
def test_vllms_switch_serves_the_adapter_routes_as_vllm_reads_it(
    value: str | None, routes: bool
) -> None:
    """VLLM_ALLOW_RUNTIME_LORA_UPDATING: 1 or true, any case, around spaces (vLLM's envs.py)."""
    environ = {} if value is None else {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": value}
    assert with_vllm_environment(ServerConfig(), environ).allow_runtime_lora_updating is routes
    flagged = ServerConfig(allow_runtime_lora_updating=True)
    assert with_vllm_environment(flagged, environ) == flagged
