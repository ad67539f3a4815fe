"""The flags sglang's server accepts, by the kind of value each takes: a table for checking
serve.extra_args and EXTRA_FLAGS before a launch.

Read with `ast` from the `parser.add_argument(...)` calls of python/sglang/srt/server_args.py
in iforgetmyname/sglang @ 7b7e357f6112ac8f496f5a58b49c4e94632250ae (branch main, Dec 2025):
the fork the pin comes from, not the pin itself (298193eb, branch dsv4_release, is not
stored where this was read). Added: the two flags sglang/0002 of the delivery
(cann-recipes-infer @ 1a7fbd34, server_args.py hunk) declares. Because the pin is newer
than this table, a flag missing here is a warning (with the nearest known name), never a
refusal; a known flag given a value of the wrong kind is refused.
"""

from __future__ import annotations

SOURCE = ("iforgetmyname/sglang @ 7b7e357f python/sglang/srt/server_args.py (the fork's main, "
          "not the pin 298193eb) + the delivery's sglang/0002")

# no value (store_true / store_false / const actions)
SWITCHES: frozenset[str] = frozenset({
    "--abort-on-priority-when-disabled", "--allow-auto-truncate",
    "--checkpoint-engine-wait-weights-before-ready", "--collect-tokens-histogram",
    "--constrained-json-disable-any-whitespace", "--delete-ckpt-after-loading",
    "--disable-chunked-prefix-cache", "--disable-cuda-graph", "--disable-cuda-graph-padding",
    "--disable-custom-all-reduce", "--disable-fast-image-processor",
    "--disable-flashinfer-autotune", "--disable-flashinfer-cutlass-moe-fp4-allgather",
    "--disable-hybrid-swa-memory", "--disable-outlines-disk-cache", "--disable-overlap-schedule",
    "--disable-radix-cache", "--disable-shared-experts-fusion",
    "--disable-tokenizer-batch-decode", "--disaggregation-decode-enable-fake-auto",
    "--disaggregation-decode-enable-offload-kvcache", "--enable-attn-tp-input-scattered",
    "--enable-broadcast-mm-inputs-process", "--enable-cache-report", "--enable-cudagraph-gc",
    "--enable-custom-logit-processor", "--enable-deterministic-inference",
    "--enable-double-sparsity", "--enable-dp-attention", "--enable-dp-lm-head",
    "--enable-draft-weights-cpu-backup", "--enable-dynamic-batch-tokenizer",
    "--enable-dynamic-chunking", "--enable-eplb", "--enable-expert-distribution-metrics",
    "--enable-flashinfer-allreduce-fusion", "--enable-fp32-lm-head",
    "--enable-fused-qk-norm-rope", "--enable-hierarchical-cache",
    "--enable-layerwise-nvtx-marker", "--enable-lmcache", "--enable-lora",
    "--enable-memory-saver", "--enable-metrics", "--enable-metrics-for-all-schedulers",
    "--enable-mixed-chunk", "--enable-mscclpp", "--enable-multi-layer-eagle",
    "--enable-multimodal", "--enable-nan-detection", "--enable-nccl-nvls",
    "--enable-nsa-prefill-context-parallel", "--enable-p2p-check", "--enable-pdmux",
    "--enable-piecewise-cuda-graph", "--enable-prefix-mm-cache", "--enable-priority-scheduling",
    "--enable-profile-cuda-graph", "--enable-request-time-stats-logging",
    "--enable-return-hidden-states", "--enable-return-routed-experts",
    "--enable-single-batch-overlap", "--enable-symm-mem", "--enable-tokenizer-batch-encode",
    "--enable-torch-compile", "--enable-torch-compile-debug-mode", "--enable-torch-symm-mem",
    "--enable-trace", "--enable-two-batch-overlap", "--enable-weights-cpu-backup",
    "--encoder-only", "--export-metrics-to-file", "--flashinfer-mla-disable-ragged",
    "--grpc-mode", "--is-embedding", "--keep-mm-feature-on-device", "--language-only",
    "--log-requests", "--mm-enable-dp-encoder", "--prefill-round-robin-balance",
    "--quantize-and-serve", "--remote-instance-weight-loader-start-seed-via-transfer-engine",
    "--schedule-low-priority-values-first", "--show-time-cost", "--skip-server-warmup",
    "--skip-tokenizer-init", "--sleep-on-idle", "--stream-output",
    "--triton-attention-reduce-in-fp32", "--trust-remote-code", "--weight-loader-disable-mmap"
})

# one integer
INTS: frozenset[str] = frozenset({
    "--base-gpu-id", "--chunked-prefill-size", "--context-length", "--cpu-offload-gb",
    "--cuda-graph-max-bs", "--data-parallel-size", "--decode-log-interval",
    "--disaggregation-bootstrap-port", "--disaggregation-decode-dp",
    "--disaggregation-decode-polling-interval", "--disaggregation-decode-tp",
    "--disaggregation-prefill-pp", "--dist-timeout", "--dp-size", "--ds-heavy-channel-num",
    "--ds-heavy-token-num", "--ds-sparse-decode-threshold",
    "--dynamic-batch-tokenizer-batch-size", "--ep", "--ep-num-redundant-experts", "--ep-size",
    "--eplb-rebalance-layers-per-chunk", "--eplb-rebalance-num-iterations",
    "--expert-distribution-recorder-buffer-size", "--expert-parallel-size", "--gpu-id-step",
    "--hicache-size", "--kt-cpuinfer", "--kt-max-deferred-experts-per-token",
    "--kt-num-gpu-experts", "--kt-threadpool-count", "--log-requests-level",
    "--mamba-track-interval", "--max-loaded-loras", "--max-lora-chunk-size", "--max-lora-rank",
    "--max-loras-per-batch", "--max-mamba-cache-size", "--max-prefill-tokens",
    "--max-queued-requests", "--max-running-requests", "--max-total-tokens",
    "--mm-max-concurrent-calls", "--mm-per-request-timeout", "--moe-dense-tp-size",
    "--multi-item-scoring-delimiter", "--nccl-port", "--nnodes", "--node-rank",
    "--num-continuous-decode-steps", "--num-reserved-decode-tokens", "--offload-group-size",
    "--offload-num-in-group", "--offload-prefetch-step", "--page-size",
    "--piecewise-cuda-graph-max-tokens", "--pipeline-parallel-size", "--port",
    "--pp-async-batch-depth", "--pp-max-micro-batch-size", "--pp-size", "--prefill-max-requests",
    "--priority-scheduling-preemption-threshold", "--random-seed",
    "--remote-instance-weight-loader-seed-instance-service-port", "--scheduler-recv-interval",
    "--sm-group-num", "--speculative-eagle-topk", "--speculative-ngram-branch-length",
    "--speculative-ngram-capacity", "--speculative-ngram-max-bfs-breadth",
    "--speculative-ngram-max-match-window-size", "--speculative-ngram-min-bfs-breadth",
    "--speculative-ngram-min-match-window-size", "--speculative-num-draft-tokens",
    "--speculative-num-steps", "--stream-interval", "--tensor-parallel-size",
    "--tokenizer-worker-num", "--torch-compile-max-bs", "--tp-size",
    "--triton-attention-num-kv-splits", "--triton-attention-split-tile-size"
})

# one number
FLOATS: frozenset[str] = frozenset({
    "--dynamic-batch-tokenizer-batch-timeout", "--eplb-min-rebalancing-utilization-threshold",
    "--gc-warning-threshold-secs", "--hicache-ratio", "--mamba-full-memory-ratio",
    "--mem-fraction-static", "--schedule-conservativeness", "--soft-watchdog-timeout",
    "--speculative-accept-threshold-acc", "--speculative-accept-threshold-single",
    "--swa-full-tokens-ratio", "--tbo-token-distribution-threshold", "--watchdog-timeout"
})

# one value
STRINGS: frozenset[str] = frozenset({
    "--api-key", "--attention-backend", "--chat-template", "--completion-template", "--config",
    "--constrained-json-whitespace-pattern", "--crash-dump-folder", "--custom-sigquit-handler",
    "--debug-tensor-dump-inject", "--debug-tensor-dump-input-file",
    "--debug-tensor-dump-output-folder", "--decode-attention-backend", "--decrypted-config-file",
    "--decrypted-draft-config-file", "--deepep-config", "--deepep-mode", "--device",
    "--disaggregation-ib-device", "--disaggregation-mode", "--disaggregation-transfer-backend",
    "--dist-init-addr", "--dllm-algorithm", "--dllm-algorithm-config", "--download-dir",
    "--ds-channel-config-path", "--ds-heavy-channel-type", "--dtype", "--elastic-ep-backend",
    "--encoder-transfer-backend", "--ep-dispatch-algorithm", "--eplb-algorithm",
    "--expert-distribution-recorder-mode", "--export-metrics-to-file-dir", "--fastapi-root-path",
    "--file-storage-path", "--flashinfer-mxfp4-moe-precision", "--forward-hooks",
    "--fp8-gemm-backend", "--grammar-backend", "--hicache-io-backend", "--hicache-mem-layout",
    "--hicache-storage-backend", "--hicache-storage-backend-extra-config",
    "--hicache-storage-prefetch-policy", "--hicache-write-policy", "--host",
    "--init-expert-location", "--json-model-override-args", "--kt-activation-freq-path",
    "--kt-expert-placement-strategy", "--kt-method", "--kt-weight-path", "--kv-cache-dtype",
    "--kv-events-config", "--limit-mm-data-per-request", "--load-balance-method", "--load-format",
    "--log-level", "--log-level-http", "--log-requests-format", "--lora-backend",
    "--lora-eviction-policy", "--mamba-scheduler-strategy", "--mamba-ssm-dtype",
    "--mm-attention-backend", "--mm-process-config", "--model", "--model-impl",
    "--model-loader-extra-config", "--model-path", "--modelopt-checkpoint-restore-path",
    "--modelopt-checkpoint-save-path", "--modelopt-export-path", "--modelopt-quant",
    "--moe-a2a-backend", "--moe-runner-backend", "--mooncake-ib-device", "--nccl-init-addr",
    "--nsa-decode-backend", "--nsa-prefill-backend", "--offload-mode", "--otlp-traces-endpoint",
    "--pdmux-config-path", "--piecewise-cuda-graph-compiler", "--piecewise-cuda-graph-tokens",
    "--preferred-sampling-params", "--prefill-attention-backend", "--quantization",
    "--quantization-param-path", "--radix-eviction-policy", "--reasoning-parser",
    "--remote-instance-weight-loader-backend", "--remote-instance-weight-loader-seed-instance-ip",
    "--remote-instance-weight-loader-send-weights-group-ports", "--revision",
    "--rl-on-policy-target", "--rl-quant-profile", "--sampling-backend", "--sampling-defaults",
    "--schedule-policy", "--served-model-name", "--speculative-algorithm",
    "--speculative-attention-mode", "--speculative-draft-attention-backend",
    "--speculative-draft-load-format", "--speculative-draft-model",
    "--speculative-draft-model-path", "--speculative-draft-model-quantization",
    "--speculative-draft-model-revision", "--speculative-moe-a2a-backend",
    "--speculative-moe-runner-backend", "--speculative-ngram-match-type",
    "--speculative-token-map", "--tokenizer-metrics-custom-labels-header", "--tokenizer-mode",
    "--tokenizer-path", "--tool-call-parser", "--tool-server", "--torchao-config", "--warmups",
    "--weight-version"
})

# one or more values (nargs)
LISTS: frozenset[str] = frozenset({
    "--bucket-e2e-request-latency", "--bucket-inter-token-latency",
    "--bucket-time-to-first-token", "--cuda-graph-bs", "--custom-weight-loader",
    "--debug-tensor-dump-layers", "--encoder-urls", "--generation-tokens-buckets",
    "--hybrid-kvcache-ratio", "--lora-paths", "--lora-target-modules", "--numa-node",
    "--prompt-tokens-buckets", "--tokenizer-metrics-allowed-custom-labels"
})

