"""`ServerConfig`: the HTTP front end's options (`blockserve serve` flags), declared once; the
CLI builds its parser from them, so this module imports no torch and no FastAPI."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from blockserve.errors import InvalidConfigError
from blockserve.options import at_least, option, positive, validate

TOOL_CALL_PARSERS = ("hermes",)


def _port(value: int) -> str | None:
    return None if 0 <= value <= 65535 else f"must be in 0..65535, got {value!r}"


def _non_empty_strings(values: tuple[str, ...]) -> str | None:
    if not isinstance(values, tuple) or not all(isinstance(v, str) and v for v in values):
        return f"must be a tuple of non-empty strings, got {values!r}"
    return None


def _non_empty_string(value: str) -> str | None:
    return None if value else "must not be empty"


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """The HTTP front end's options (`blockserve serve` flags).

    With no `api_key` every route is open. With keys, every route but `/health` needs one
    (`/metrics` too, unless `metrics_without_auth`). The CLI adds the keys of `api_keys_file`
    and, when no key is given at all, falls back to the BLOCKSERVE_API_KEY variable.
    """

    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(8000, "port to listen on", check=_port)
    served_model_name: tuple[str, ...] = option(
        (),
        "one or more names the API serves the model under (requests may use any; responses "
        "and metrics use the first); default: the --model string as given, or the embedded "
        "model's name",
        check=_non_empty_strings,
    )
    api_key: tuple[str, ...] = option(
        (),
        "require `Authorization: Bearer KEY` on every route but /health; give several keys "
        "after one flag or repeat it (default: BLOCKSERVE_API_KEY, if set)",
        check=_non_empty_strings,
        secret=True,
    )
    api_keys_file: str | None = option(
        None, "a file of API keys, one per line (blank lines and # comments are skipped)"
    )
    metrics_without_auth: bool = option(False, "serve /metrics without an API key")
    allow_runtime_lora_updating: bool = option(
        False,
        "serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's routes; off "
        "by default: a request names a path the server then reads; vLLM's switch, "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, turns them on too)",
    )
    enable_debug_endpoints: bool = option(
        False, "serve /debug/kv_cache (pool occupancy, which shows other tenants' activity)"
    )
    cache_salt_per_key: bool = option(
        False,
        "derive each request's cache_salt from its API key (a client's own salt is kept "
        "under it), so tenants never share cached blocks",
    )
    max_request_body_bytes: int = option(
        8 << 20,
        "largest request body accepted; a larger one is a 413 before it is read",
        check=positive,
    )
    default_chat_max_tokens: int = option(
        2048,
        "max_tokens of a chat completion that gives neither max_tokens nor "
        "max_completion_tokens (less if the context leaves less)",
        check=positive,
    )
    trust_chat_special_tokens: bool = option(
        False,
        "let special-token text inside chat messages (<|im_start|>, ...) become special "
        "tokens, as it once did; by default it is plain text, so a message cannot forge a turn",
    )
    max_prompts_per_request: int = option(
        2048, "most prompts one completions request may list (OpenAI's bound)", check=positive
    )
    max_stop_strings: int = option(64, "most stop strings one request may give", check=positive)
    max_stop_chars: int = option(
        4096, "most characters one request's stop strings may have together", check=positive
    )
    max_request_tokens: int = option(
        262144,
        "most tokens one request may ask to generate: prompts x n x max_tokens (without "
        "max_tokens, up to the context's end)",
        check=positive,
    )
    header_timeout: float = option(
        10.0,
        "seconds a connection has to send a request's line and headers, from its start or "
        "its previous response; then it is closed",
        check=positive,
    )
    body_timeout: float = option(
        30.0, "seconds to wait for each chunk of a request body; then a 408", check=positive
    )
    stream_write_timeout: float = option(
        30.0,
        "seconds a streamed response may wait on a client that reads nothing; then its "
        "request is aborted (blocks freed) and the connection closed. vLLM has no such bound",
        check=positive,
    )
    timeout_keep_alive: int = option(
        5, "seconds an idle keep-alive connection stays open (uvicorn's)", check=positive
    )
    tokenizer_workers: int = option(
        2, "threads that tokenize prompts and render chat templates", check=positive
    )
    enable_auto_tool_choice: bool = option(
        False,
        'answer tool_choice "auto" (the default once tools are given): the model chooses '
        "between text and calls, read out of its text by --tool-call-parser",
    )
    tool_call_parser: str | None = option(
        None,
        "the model's tool-call format, for --enable-auto-tool-choice: hermes "
        '(<tool_call>{"name": ..., "arguments": ...}</tool_call>, as Qwen2.5 and Hermes '
        "models write)",
        choices=TOOL_CALL_PARSERS,
    )
    shutdown_timeout: float = option(
        30.0,
        "seconds running requests get to finish after SIGTERM; then each ends with an error",
        check=at_least(0),
    )
    disable_log_stats: bool = option(False, "no periodic stats line (vLLM's flag)")
    disable_log_requests: bool = option(
        False, "vLLM's older flag, accepted: this server logs no request's contents"
    )
    response_role: str = option(
        "assistant",
        "the role of a chat completion's message when the request adds the generation prompt "
        "(without it, the role of the request's last message), as in vLLM",
        check=_non_empty_string,
    )
    uvicorn_log_level: str = option(
        "info",
        "uvicorn's log level (vLLM's flag)",
        choices=("critical", "error", "warning", "info", "debug", "trace"),
    )
    stats_interval_s: float = 10.0

    def __post_init__(self) -> None:
        validate(self)
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise InvalidConfigError(
                "enable_auto_tool_choice (--enable-auto-tool-choice) needs --tool-call-parser"
            )


def with_vllm_environment(config: ServerConfig, environ: Mapping[str, str]) -> ServerConfig:
    """The config with vLLM's environment switches read as vLLM reads them:
    VLLM_ALLOW_RUNTIME_LORA_UPDATING (1 or true, any case) serves the adapter routes."""
    value = environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower()
    if value in ("1", "true"):
        return dataclasses.replace(config, allow_runtime_lora_updating=True)
    return config
