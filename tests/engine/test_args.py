"""EngineArgs: every engine option once; the CLI flags and `LLM(**kwargs)` agree on each."""

from __future__ import annotations

import dataclasses

import pytest

from blockserve import LLM
from blockserve.cli import build_parser
from blockserve.config import (
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    RuntimeConfig,
    SchedulerConfig,
)
from blockserve.cpu_threads import host_thread_plan
from blockserve.engine.args import EngineArgs
from blockserve.errors import InvalidConfigError
from blockserve.events.config import KVEventsConfig

# One good non-default value per field: (keyword value, the same as serve flags).
GOOD: dict[str, tuple[object, list[str]]] = {
    "model": ("/models/m", ["--model", "/models/m"]),
    "enable_prefix_caching": (False, ["--no-enable-prefix-caching"]),
    "block_size": (32, ["--block-size", "32"]),
    "prefix_caching_hash_algo": ("xxhash", ["--prefix-caching-hash-algo", "xxhash"]),
    "eviction_policy": ("lfu", ["--eviction-policy", "lfu"]),
    "tlru_threshold_tokens": (256, ["--tlru-threshold-tokens", "256"]),
    "tlru_next_prompt_tokens": (64, ["--tlru-next-prompt-tokens", "64"]),
    "miss_ratio_samples": (0, ["--miss-ratio-samples", "0"]),
    "structured_outputs_max_whitespace": (0, ["--structured-outputs-max-whitespace", "0"]),
    "structured_outputs_max_bytes": (1024, ["--structured-outputs-max-bytes", "1024"]),
    "structured_outputs_max_rules": (10, ["--structured-outputs-max-rules", "10"]),
    "structured_outputs_max_choices": (5, ["--structured-outputs-max-choices", "5"]),
    "structured_outputs_max_nesting": (8, ["--structured-outputs-max-nesting", "8"]),
    "structured_outputs_compile_timeout": (
        2.5,
        ["--structured-outputs-compile-timeout", "2.5"],
    ),
    "max_request_seq_share": (0.25, ["--max-request-seq-share", "0.25"]),
    "generation_config": ("vllm", ["--generation-config", "vllm"]),
    "scheduling_policy": ("lpm", ["--scheduling-policy", "lpm"]),
    "lpm_aging_s": (2.5, ["--lpm-aging-s", "2.5"]),
    "max_num_seqs": (8, ["--max-num-seqs", "8"]),
    "limit_mm_per_prompt": ({"image": 2}, ["--limit-mm-per-prompt", '{"image": 2}']),
    "allowed_media_domains": (("images.example",), ["--allowed-media-domains", "images.example"]),
    "allowed_local_media_path": ("/srv/images", ["--allowed-local-media-path", "/srv/images"]),
    "mm_hasher_algorithm": ("sha256", ["--mm-hasher-algorithm", "sha256"]),
    "mm_processor_cache_gb": (0.5, ["--mm-processor-cache-gb", "0.5"]),
    "quantization": ("gguf", ["--quantization", "gguf"]),
    "max_num_batched_tokens": (512, ["--max-num-batched-tokens", "512"]),
    "max_n": (4, ["--max-n", "4"]),
    "encoder_cache_size": (4096, ["--encoder-cache-size", "4096"]),
    "max_model_len": (1024, ["--max-model-len", "1024"]),
    "kv_cache_memory_bytes": (1 << 20, ["--kv-cache-memory-bytes", str(1 << 20)]),
    "gpu_memory_utilization": (0.5, ["--gpu-memory-utilization", "0.5"]),
    "num_gpu_blocks_override": (64, ["--num-gpu-blocks-override", "64"]),
    "dtype": ("float32", ["--dtype", "float32"]),
    "attention_backend": ("torch", ["--attention-backend", "torch"]),
    "device": ("cuda:1", ["--device", "cuda:1"]),
    "seed": (7, ["--seed", "7"]),
    "compile": (True, ["--compile"]),
    "enforce_eager": (True, ["--enforce-eager"]),
    "cuda_graph_sizes": ((1, 2, 8), ["--cuda-graph-sizes", "1", "2", "8"]),
    "async_scheduling": (True, ["--async-scheduling"]),
    "revision": ("v1.0", ["--revision", "v1.0"]),
    "download_dir": ("/srv/hub", ["--download-dir", "/srv/hub"]),
    "tokenizer": ("org/tokenizer", ["--tokenizer", "org/tokenizer"]),
    "max_logprobs": (5, ["--max-logprobs", "5"]),
    "cpu_threads": (1, ["--cpu-threads", "1"]),
    "enable_lora": (True, ["--enable-lora"]),
    "lora_modules": (
        ("a=/x", '{"name": "b", "path": "/y"}'),
        ["--lora-modules", "a=/x", '{"name": "b", "path": "/y"}'],
    ),
    "max_loras": (3, ["--max-loras", "3"]),
    "max_lora_rank": (8, ["--max-lora-rank", "8"]),
    "max_cpu_loras": (4, ["--max-cpu-loras", "4"]),
    "chat_template": ("{{ messages }}", ["--chat-template", "{{ messages }}"]),
    "tensor_parallel_size": (1, ["--tensor-parallel-size", "1"]),
    "enable_chunked_prefill": (True, ["--enable-chunked-prefill"]),
    "swap_space": (None, []),
    "trust_remote_code": (True, ["--trust-remote-code"]),
    "load_format": ("safetensors", ["--load-format", "safetensors"]),
    "kv_offloading_size": (1.5, ["--kv-offloading-size", "1.5"]),
    "kv_cache_dir": ("/var/kv", ["--kv-cache-dir", "/var/kv"]),
    "kv_disk_size": (2.0, ["--kv-disk-size", "2"]),
    "kv_cache_dir_clear_mismatch": (True, ["--kv-cache-dir-clear-mismatch"]),
    "kv_remote_url": ("redis://127.0.0.1:6379/0", ["--kv-remote-url", "redis://127.0.0.1:6379/0"]),
    "kv_remote_secret": ("s3cret", ["--kv-remote-secret", "s3cret"]),
    "kv_events_config": (
        '{"enable_kv_cache_events": true, "publisher": "zmq"}',
        ["--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "zmq"}'],
    ),
}

# Bad values per field: (keyword value, the same as flags, or None where a flag cannot say it).
BAD: dict[str, list[tuple[object, list[str] | None]]] = {
    "model": [(3, None)],
    "enable_prefix_caching": [("yes", None)],
    "block_size": [(0, ["--block-size", "0"]), (16.0, None)],
    "prefix_caching_hash_algo": [("md5", ["--prefix-caching-hash-algo", "md5"])],
    "eviction_policy": [("mru", ["--eviction-policy", "mru"])],
    "tlru_threshold_tokens": [(-1, ["--tlru-threshold-tokens", "-1"])],
    "tlru_next_prompt_tokens": [(-5, ["--tlru-next-prompt-tokens", "-5"])],
    "miss_ratio_samples": [(-1, ["--miss-ratio-samples", "-1"])],
    "structured_outputs_max_whitespace": [(-2, ["--structured-outputs-max-whitespace", "-2"])],
    "structured_outputs_max_bytes": [(0, ["--structured-outputs-max-bytes", "0"])],
    "structured_outputs_max_rules": [(0, ["--structured-outputs-max-rules", "0"])],
    "structured_outputs_max_choices": [(-1, ["--structured-outputs-max-choices", "-1"])],
    "structured_outputs_max_nesting": [(0, ["--structured-outputs-max-nesting", "0"])],
    "structured_outputs_compile_timeout": [(0.0, ["--structured-outputs-compile-timeout", "0"])],
    "max_request_seq_share": [
        (0, ["--max-request-seq-share", "0"]),
        (1.5, ["--max-request-seq-share", "1.5"]),
    ],
    "generation_config": [("", ["--generation-config", ""]), (3, None)],
    "scheduling_policy": [("lifo", ["--scheduling-policy", "lifo"])],
    "lpm_aging_s": [
        (-1.0, ["--lpm-aging-s", "-1"]),
        (float("inf"), ["--lpm-aging-s", "inf"]),
        ("10", None),
    ],
    "max_num_seqs": [(0, ["--max-num-seqs", "0"]), (True, None)],
    "max_num_batched_tokens": [(-1, ["--max-num-batched-tokens", "-1"])],
    "max_n": [(0, ["--max-n", "0"])],
    "encoder_cache_size": [(-1, ["--encoder-cache-size", "-1"])],
    "max_model_len": [(0, ["--max-model-len", "0"])],
    "kv_cache_memory_bytes": [(0, ["--kv-cache-memory-bytes", "0"])],
    "gpu_memory_utilization": [
        (0.0, ["--gpu-memory-utilization", "0"]),
        (1.5, ["--gpu-memory-utilization", "1.5"]),
    ],
    "num_gpu_blocks_override": [
        (1, ["--num-gpu-blocks-override", "1"]),
        (-3, ["--num-gpu-blocks-override", "-3"]),
    ],
    "dtype": [("float16", ["--dtype", "float16"])],
    "attention_backend": [("flash", ["--attention-backend", "flash"])],
    "device": [("tpu", ["--device", "tpu"])],
    "seed": [("x", ["--seed", "x"])],
    "compile": [("yes", None)],
    "enforce_eager": [("yes", None)],
    "allowed_media_domains": [("images.example", None)],
    "allowed_local_media_path": [("", ["--allowed-local-media-path", ""])],
    "mm_hasher_algorithm": [("md5", ["--mm-hasher-algorithm", "md5"])],
    "mm_processor_cache_gb": [(-1.0, ["--mm-processor-cache-gb", "-1"])],
    "quantization": [("awq", ["--quantization", "awq"])],
    "limit_mm_per_prompt": [
        ('{"video": 1}', ["--limit-mm-per-prompt", '{"video": 1}']),
        ({"image": -1}, ["--limit-mm-per-prompt", '{"image": -1}']),
        ("nope", ["--limit-mm-per-prompt", "nope"]),
        (3, None),
    ],
    "cuda_graph_sizes": [
        ((0,), ["--cuda-graph-sizes", "0"]),
        (("1",), None),
        (("8", "x"), ["--cuda-graph-sizes", "8", "x"]),
        ("16", None),
        ((True,), None),
    ],
    "async_scheduling": [("yes", None)],
    "revision": [("", ["--revision", ""]), (3, None)],
    "download_dir": [("", ["--download-dir", ""])],
    "tokenizer": [("", ["--tokenizer", ""])],
    "max_logprobs": [(-1, ["--max-logprobs", "-1"])],
    "cpu_threads": [(0, ["--cpu-threads", "0"]), ("2", None)],
    "enable_lora": [("yes", None)],
    "lora_modules": [
        (("a",), ["--lora-modules", "a"]),
        (("a=/x", "a=/y"), ["--lora-modules", "a=/x", "a=/y"]),
        (('{"name": "b"}',), ["--lora-modules", '{"name": "b"}']),
    ],
    "max_loras": [(0, ["--max-loras", "0"])],
    "max_lora_rank": [(0, ["--max-lora-rank", "0"])],
    "max_cpu_loras": [(0, ["--max-cpu-loras", "0"])],
    "chat_template": [("", ["--chat-template", ""])],
    "tensor_parallel_size": [(2, ["--tensor-parallel-size", "2"])],
    "enable_chunked_prefill": [(False, ["--no-enable-chunked-prefill"])],
    "swap_space": [(4.0, ["--swap-space", "4"])],
    "trust_remote_code": [("yes", None)],
    "load_format": [("pt", ["--load-format", "pt"]), ("gguf", ["--load-format", "gguf"])],
    "kv_offloading_size": [(-1.0, ["--kv-offloading-size", "-1"]), (float("nan"), None)],
    "kv_cache_dir": [(3, None)],
    "kv_disk_size": [(-2.0, ["--kv-disk-size", "-2"])],
    "kv_cache_dir_clear_mismatch": [("yes", None)],
    "kv_remote_url": [
        ("http://127.0.0.1:6379", ["--kv-remote-url", "http://127.0.0.1:6379"]),
        ("redis://:pw@[::1", ["--kv-remote-url", "redis://:pw@[::1"]),
        ("redis://:70000", ["--kv-remote-url", "redis://:70000"]),
    ],
    "kv_remote_secret": [("", ["--kv-remote-secret", ""])],
    "kv_events_config": [
        ('{"publisher": "kafka"}', ["--kv-events-config", '{"publisher": "kafka"}']),
        ("{not json", ["--kv-events-config", "{not json"]),
        ({"endpointt": "tcp://*:1"}, None),
    ],
}


# vLLM's flags taken as vLLM takes them that change nothing here: their values are this
# engine's own (one device, chunked prefill, no remote code, the format the model has).
AS_IN_VLLM = {"tensor_parallel_size", "enable_chunked_prefill", "swap_space", "trust_remote_code",
              "load_format",
              # without --enable-lora, as in vLLM, the adapters' bounds change nothing
              "max_loras", "max_lora_rank", "max_cpu_loras"}  # fmt: skip


def configs_from_flags(flags: list[str]) -> EngineConfig:
    args = build_parser().parse_args(["serve", *flags])
    return EngineArgs.from_cli_args(args).create_configs()


def test_the_tables_cover_every_field() -> None:
    """Adding an engine option without a row here fails: every field is walked below."""
    assert set(GOOD) == set(BAD) == {f.name for f in dataclasses.fields(EngineArgs)}


@pytest.mark.parametrize("name", sorted(GOOD))
def test_flag_and_keyword_build_the_same_config(name: str) -> None:
    """The serve flag and the EngineArgs keyword (what LLM takes) give equal configs."""
    value, flags = GOOD[name]
    from_keyword = EngineArgs(**{name: value}).create_configs()  # type: ignore[arg-type]
    assert configs_from_flags(flags) == from_keyword
    assert (from_keyword == EngineArgs().create_configs()) == (name in AS_IN_VLLM)


@pytest.mark.parametrize(
    ("name", "value", "flags"),
    [(name, value, flags) for name, rows in sorted(BAD.items()) for value, flags in rows],
)
def test_flag_and_keyword_refuse_the_same_value(
    name: str, value: object, flags: list[str] | None, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bad value raises InvalidConfigError naming the field, from LLM before any model
    loads; the same value as a flag is refused too (by argparse, or the same check)."""
    with pytest.raises(InvalidConfigError) as refused:
        LLM(**{name: value})
    assert str(refused.value).startswith(f"{name} (--")
    if flags is None:
        return
    try:
        configs_from_flags(flags)
    except SystemExit as exc:  # argparse: a choice or a type it cannot convert
        assert exc.code == 2 and "invalid" in capsys.readouterr().err
    except InvalidConfigError as exc:  # the same check as the keyword's, word for word
        assert str(exc) == str(refused.value)
    else:
        pytest.fail(f"{flags} was accepted")


CONFIGS = (ModelConfig, CacheConfig, SchedulerConfig, LoRAConfig, RuntimeConfig)


def test_each_config_option_is_declared_once() -> None:
    """Every option a config declares is an EngineArgs field of the same name, annotation,
    default and declaration (the same Option: help, choices and check written once, on the config);
    EngineArgs declares the rest itself, and no two configs declare the same name."""
    fields = {f.name: f for f in dataclasses.fields(EngineArgs)}
    taken: list[str] = []
    for config in CONFIGS:
        for f in dataclasses.fields(config):
            if "option" not in f.metadata:
                continue
            taken.append(f.name)
            mirror = fields[f.name]
            assert mirror.metadata["option"] is f.metadata["option"], f.name
            assert (mirror.default, mirror.type) == (f.default, f.type), f.name
    assert len(taken) == len(set(taken))
    own = set(fields) - set(taken)
    assert own == {
        "structured_outputs_max_bytes", "structured_outputs_max_rules",
        "structured_outputs_max_choices", "structured_outputs_max_nesting",
        "structured_outputs_compile_timeout", "eviction_policy", "tlru_threshold_tokens",
        "tlru_next_prompt_tokens", "enable_lora", "lora_modules", "kv_events_config",
        "tensor_parallel_size", "enable_chunked_prefill", "swap_space", "trust_remote_code",
        "load_format", "limit_mm_per_prompt",
    }  # fmt: skip


def test_refusal_names_field_and_flag() -> None:
    """The message says which field and which flag, and what was wrong."""
    with pytest.raises(InvalidConfigError) as refused:
        EngineArgs(max_num_seqs=0).create_configs()
    assert str(refused.value) == "max_num_seqs (--max-num-seqs) must be positive, got 0"


def test_both_cache_sizes_are_refused_by_both() -> None:
    """kv_cache_memory_bytes and num_gpu_blocks_override cannot both be given."""
    with pytest.raises(InvalidConfigError, match="cannot both be set"):
        EngineArgs(kv_cache_memory_bytes=1000, num_gpu_blocks_override=10).create_configs()
    with pytest.raises(SystemExit):
        configs_from_flags(["--kv-cache-memory-bytes", "1000", "--num-gpu-blocks-override", "10"])


def test_llm_takes_exactly_the_engine_args() -> None:
    """An unknown keyword is a TypeError, as for any Python call."""
    with pytest.raises(TypeError, match="max_num_sequences"):
        LLM(max_num_sequences=4)


def test_defaults_are_vllms_and_the_configs_own() -> None:
    """Block size 16, prefix caching on, sha256, FCFS, 64 sequences, 2048 tokens a step; and
    the frozen configs' defaults (for code that builds them directly) say the same."""
    config = EngineArgs().create_configs()
    runtime = dataclasses.replace(config.runtime, threads=None)
    assert dataclasses.replace(config, runtime=runtime) == EngineConfig(
        ModelConfig(), CacheConfig(), SchedulerConfig(), None
    )
    assert config.runtime.threads == host_thread_plan(None)  # planned once, here
    assert (config.cache.block_size, config.cache.enable_prefix_caching) == (16, True)
    assert config.cache.prefix_caching_hash_algo == "sha256"
    scheduler = config.scheduler
    assert (scheduler.max_num_seqs, scheduler.max_num_batched_tokens) == (64, 2048)
    assert (scheduler.scheduling_policy, scheduler.max_n) == ("fcfs", 128)


def test_kv_events_config_accepts_json_dict_or_config() -> None:
    """The three forms of kv_events_config build the same KVEventsConfig."""
    text = '{"enable_kv_cache_events": true, "publisher": "zmq", "topic": "kv"}'
    expected = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", topic="kv")
    for value in (text, {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv"}):
        assert EngineArgs(kv_events_config=value).create_configs().kv_events == expected
    config = EngineArgs(kv_events_config=expected).create_configs()
    assert config.kv_events is expected  # a built config passes through as it is


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--tensor-parallel-size", "2"],
            "tensor_parallel_size (--tensor-parallel-size) must be 1, got 2: this engine runs one "
            "device per replica; serve more devices as replicas (blockserve serve --replicas N)",
        ),
        (
            ["--swap-space", "4"],
            "swap_space (--swap-space) is not a flag of vLLM 0.32 either: preemption recomputes, "
            "and blocks leaving the device go to the host tier (--kv-offloading-size GiB)",
        ),
        (
            ["--load-format", "gguf"],
            "load_format (--load-format) gguf does not fit the model (the embedded SmolLM2, "
            "safetensors)",
        ),
        (
            ["--model", "/models/m.gguf", "--load-format", "safetensors"],
            "load_format (--load-format) safetensors does not fit the model /models/m.gguf",
        ),
    ],
)
def test_vllm_flags_this_engine_cannot_honour_are_refused_in_one_line(
    flags: list[str], message: str
) -> None:
    with pytest.raises(InvalidConfigError) as refused:
        configs_from_flags(flags)
    assert str(refused.value) == message


def test_load_format_gguf_fits_a_gguf_model() -> None:
    configs = configs_from_flags(["--model", "/models/m.gguf", "--load-format", "gguf"])
    assert configs.model.model == "/models/m.gguf"


def test_secrets_stay_out_of_the_reprs() -> None:
    """The shared store's secret and the API keys never appear in a printed config."""
    from blockserve.server.options import ServerConfig

    args = EngineArgs(kv_remote_secret="s3cret-value", enable_prefix_caching=True)
    assert "s3cret-value" not in repr(args)
    assert "s3cret-value" not in repr(args.create_configs())
    assert "key-value" not in repr(ServerConfig(api_key=("key-value",)))
