"""vLLM 0.32's `serve` flags and HTTP routes that blockserve does not have, so that asking
for one says what it is (instead of argparse's "unrecognized arguments" or a bare 404); the
lists are checked against the peer vLLM where `make peer-vllm` built it."""

from __future__ import annotations

# vLLM 0.32's `vllm serve` flags (its parser's option strings, less the --no- forms) that
# `blockserve serve` does not take.
_FLAGS = """
    --additional-config --aggregate-engine-logging --all2all-backend --allow-credentials
    --allow-deprecated-quantization --allowed-headers
    --allowed-methods --allowed-origins
    --anthropic-disabled-thinking-effort --api-server-count --attention-config
    --aux-output-config --chat-template-content-format --code-revision --cohere-format
    --cohere-is-reasoning-model --collect-detailed-traces --compilation-config --config
    --config-format --convert --cp-kv-cache-interleave-size --cpu-distributed-timeout-seconds
    --cpu-offload-gb --cpu-offload-params --cudagraph-capture-sizes --cudagraph-metrics
    --custom-histogram-buckets --data-parallel-address --data-parallel-backend
    --data-parallel-external-lb --data-parallel-hybrid-lb
    --data-parallel-multi-port-external-lb --data-parallel-rank --data-parallel-rpc-port
    --data-parallel-size --data-parallel-size-local --data-parallel-start-rank
    --data-parallel-supervisor-port --dbo-decode-token-threshold --dbo-prefill-token-threshold
    --dcp-comm-backend --dcp-kv-cache-interleave-size --dcp-q-replicate
    --decode-context-parallel-size --default-chat-template-kwargs --default-mm-loras
    --device-ids --device-memory-utilization --diffusion-config
    --disable-access-log-for-endpoints --disable-cascade-attn --disable-chunked-mm-input
    --disable-custom-all-reduce --disable-fastapi-docs --disable-hybrid-kv-cache-manager
    --disable-nccl-for-dp-synchronization --disable-sliding-window --disable-uvicorn-access-log
    --distributed-executor-backend --distributed-timeout-seconds
    --dp-supervisor-probe-failure-threshold --dp-supervisor-probe-interval-s
    --dp-supervisor-probe-timeout-s --dp-sync-interval --ec-manager-config --ec-transfer-config
    --elastic-ep-max-dp-size --enable-batch-sharded-sampling --enable-cumem-allocator
    --enable-dbo --enable-elastic-ep --enable-ep-weight-filter --enable-eplb
    --enable-expert-parallel --enable-fault-tolerance --enable-flash-late-interaction
    --enable-flashinfer-autotune --enable-force-include-usage --enable-hc-sp
    --enable-layerwise-nvtx-tracing --enable-log-deltas --enable-log-outputs
    --enable-log-requests --enable-logging-iteration-details
    --enable-mamba-cache-stochastic-rounding --enable-mamba-shared-prefix-checkpoint
    --enable-mfu-metrics --enable-mixed-moe-lora-format --enable-mm-embeds
    --enable-moe-shared-loras --enable-nccl-comm-suspend --enable-offline-docs
    --enable-per-request-metrics --enable-prompt-embeds --enable-prompt-tokens-details
    --enable-request-id-headers --enable-return-routed-experts --enable-scale-out
    --enable-server-load-tracking --enable-shm-tensor-arena --enable-sleep-mode
    --enable-ssl-refresh --enable-tokenizer-info-endpoint --enable-tower-connector-lora
    --enable-trace-replay --engram-config --eplb-config --exclude-tools-when-tool-choice-none
    --expert-placement-strategy --fail-on-environ-validation --fault-tolerance-config
    --fingerprint-mode --fingerprint-value --fully-sharded-loras --gdn-prefill-backend --grpc
    --grpc-port --h11-max-header-count --h11-max-incomplete-event-size --headless
    --hf-config-path --hf-overrides --hf-token --ignore-patterns --interleave-mm-strings
    --io-processor-plugin --ir-op-priority --jit-monitor-mode --jit-monitor-verbose
    --kda-decode-backend --kda-prefill-backend --kernel-config --kv-cache-dtype
    --kv-cache-dtype-skip-layers --kv-cache-metrics --kv-cache-metrics-sample
    --kv-offloading-backend --kv-sharing-fast-prefill --kv-transfer-config
    --language-model-only --linear-backend --log-config-file
    --log-error-stack --log-level --logging-config --logits-processors --logprobs-mode
    --long-prefill-token-threshold --long-prefill-token-threshold-adaptive --lora-dtype
    --lora-target-modules --mamba-backend --mamba-block-size --mamba-cache-dtype
    --mamba-cache-mode --mamba-cache-philox-rounds --mamba-ssm-cache-dtype
    --mamba-ssu-algorithm --master-addr --master-port --max-cudagraph-capture-size
    --max-log-len --max-lora-cls-labels --max-num-active-seqs --max-num-queued-reqs
    --max-num-queued-tokens --max-num-scheduled-tokens --max-parallel-loading-workers
    --media-io-kwargs --middleware --mm-device-do-normalize --mm-encoder-attn-backend
    --mm-encoder-attn-dtype --mm-encoder-fp8-scale-path --mm-encoder-fp8-scale-save-margin
    --mm-encoder-fp8-scale-save-path --mm-encoder-only --mm-encoder-tp-mode
    --mm-ipc-gpu-memory-gb
    --mm-processor-cache-type --mm-processor-device --mm-processor-kwargs
    --mm-shm-cache-max-object-size-mb --mm-tensor-ipc --model-class-overrides --model-impl
    --model-loader-extra-config --moe-backend --nnodes --node-rank --numa-bind --numa-bind-cpus
    --numa-bind-nodes --offload-backend --offload-group-size --offload-num-in-group
    --offload-params --offload-prefetch-step --optimization-level --otlp-traces-endpoint
    --override-generation-config --per-request-spec-decode-metrics --performance-mode
    --pipeline-parallel-size --pooler-config --prefill-context-parallel-size
    --prefill-schedule-interval --prefix-cache-retention-interval --prefix-match-unit
    --profiler-config --pt-load-map-location --quantization-config
    --ray-workers-use-nsight --reasoning-config --reasoning-parser --reasoning-parser-plugin
    --renderer-num-workers --replayssm-buffer-len --return-sampling-mask
    --return-tokens-as-token-ids --root-path --runner --safetensors-load-strategy
    --safetensors-prefetch-block-size --safetensors-prefetch-num-threads --scheduler-cls
    --scheduler-reserve-full-isl --show-hidden-metrics-for-version --skip-mm-profiling
    --skip-tokenizer-init --sleep-mode-offload-cudagraph --sleep-preserve-parameter-names
    --sparse-indexer-topk-backend --spec-method --spec-model --spec-tokens
    --specialize-active-lora --speculative-config --sse-keep-alive-interval --ssl-ca-certs
    --ssl-cert-reqs --ssl-certfile --ssl-ciphers --ssl-keyfile --stream-interval
    --structured-outputs-config --swa-bounded-replay --tokenizer-mode --tokenizer-revision
    --tokens-only --tool-parser-plugin --tool-server --tool-strict-level
    --trust-request-chat-template --trust-request-mm-kwargs --ubatch-size --uds
    --use-fp64-gumbel --use-replayssm --use-tqdm-on-load --video-pruning-method
    --video-pruning-rate --watermark --watermark-config --weight-transfer-config --worker-cls
    --worker-extension-cls
"""
VLLM_ONLY_FLAGS = frozenset(_FLAGS.split())

# What blockserve does instead, for the flags a vLLM user reaches for first.
INSTEAD = {
    "--kv-cache-dtype": "the KV cache is kept in --dtype",
    "--pipeline-parallel-size": "one device per replica; serve more as replicas (--replicas N)",
    "--data-parallel-size": "one device per replica; serve more as replicas (--replicas N)",
    "--cpu-offload-gb": "blocks, not weights, go to host memory (--kv-offloading-size GiB)",
}

# vLLM 0.32's routes that blockserve does not serve (a path with {...} stands for any value).
_ROUTES = """
    /v1/embeddings /v1/responses /v1/responses/{response_id} /v1/responses/{response_id}/cancel
    /v1/responses/render /v1/messages /v1/messages/count_tokens /v1/messages/render
    /v1/audio/transcriptions /v1/audio/translations /v1/realtime /v1/score /score /v1/rerank
    /rerank /v2/rerank /pooling /classify /invocations /ping /load /server_info
    /tokenizer_info /is_sleeping /sleep /wake_up /pause /resume /is_paused /reset_prefix_cache
    /reset_mm_cache /reset_encoder_cache /start_profile /stop_profile /collective_rpc
    /v1/chat/completions/batch /v1/chat/completions/render /v1/completions/render
"""
VLLM_ONLY_ROUTES = frozenset(_ROUTES.split())


def unsupported_flag(flag: str) -> str | None:
    """`--x is a vLLM option ...` for a vLLM flag blockserve lacks (`--x=v` too), else None."""
    name = flag.split("=", 1)[0]
    if name not in VLLM_ONLY_FLAGS:
        return None
    instead = INSTEAD.get(name)
    return f"{name} is a vLLM option blockserve does not support yet" + (
        f" ({instead})" if instead else ""
    )


def is_vllm_route(path: str) -> bool:
    """Whether `path` is one of vLLM's routes blockserve does not serve."""
    parts = path.rstrip("/").split("/")
    for route in VLLM_ONLY_ROUTES:
        pattern = route.split("/")
        if len(pattern) == len(parts) and all(
            p == q or p.startswith("{") for p, q in zip(pattern, parts, strict=True)
        ):
            return True
    return False
