"""Facts the server prints while it starts, read from its log: HBM left, the KV pools' sizes.

Each pattern names the code that prints the line; none of them is read from the pinned
sglang (298193eb, not stored where this was checked), so a line missing from a log means
"unknown", never a failure.
"""

from __future__ import annotations

import re
from typing import Any

# sglang scheduler's start-up line, "... context_len=N, available_gpu_mem=8.75 GB":
# iforgetmyname/sglang @ 7b7e357f (main, not the pin) python/sglang/srt/managers/scheduler.py
# :593-600; the guide quotes it at G645 ("available_gpu_mem=8.75 GB")
_AVAILABLE = re.compile(r"available_gpu_mem=([0-9.]+) GB")
_MAX_TOKENS = re.compile(r"max_total_num_tokens=(\d+)")
# the DSv4 NPU pool's sizes, f"[SWAC4C128KVPool] {size=}, {size_swa=}, ..." - upstream, not
# the pin: sgl-project/sglang @ c00daab0,
# python/sglang/srt/hardware_backend/npu/hybrid_swa_c4_c128_memory_pool.py (__init__)
_SWA_POOL = re.compile(r"\[SWAC4C128KVPool\] size=(\d+), size_swa=(\d+)")
# same file: f"SWAC4C128KVPool mem usage: {self.mem_usage:.2f} GB. page_size: ..." (G642)
_POOL_MEM = re.compile(r"SWAC4C128KVPool mem usage: ([0-9.]+) GB")
# delivery sglang/0003 patch line 997 (kt_stream_prefill.py:991):
# "[KT_STREAM] inline resident: top-{K} x {n} layers folded into prefill, share=..."
INLINE_RESIDENT = re.compile(r"\[KT_STREAM\] inline resident: top-(\d+) x (\d+) layers")
# delivery sglang/0003 patch line 1131 (kt_stream_prefill.py:1125)
FALLBACK = re.compile(r"\[KT_STREAM\] streaming failed \(.*\) -> hybrid fallback")

SOURCES = {
    "available_gpu_mem_gb": "sglang scheduler start-up line (fork main @ 7b7e357f "
                            "scheduler.py:593-600, not the pin)",
    "swa_pool_tokens": "[SWAC4C128KVPool] size_swa= (upstream sgl-project/sglang @ c00daab0 "
                       "hybrid_swa_c4_c128_memory_pool.py, not the pin)",
}


def startup_facts(log_text: str) -> dict[str, Any]:
    """What the start-up lines say; a fact whose line is absent is left out."""
    facts: dict[str, Any] = {}
    last = _last(_AVAILABLE, log_text)
    if last:
        facts["available_gpu_mem_gb"] = float(last.group(1))
    last = _last(_MAX_TOKENS, log_text)
    if last:
        facts["max_total_num_tokens"] = int(last.group(1))
    last = _last(_SWA_POOL, log_text)
    if last:
        facts["kv_pool_tokens"] = int(last.group(1))
        facts["swa_pool_tokens"] = int(last.group(2))
    last = _last(_POOL_MEM, log_text)
    if last:
        facts["kv_pool_gb"] = float(last.group(1))
    return facts


def _last(pattern: re.Pattern[str], text: str) -> re.Match[str] | None:
    found = None
    for found in pattern.finditer(text):  # noqa: B007 - the last one counts (a restart)
        pass
    return found


def longest_prompt_warning(facts: dict[str, Any], longest: int) -> str | None:
    """A prompt longer than the SWA pool is never admitted: it waits, then times out."""
    swa = facts.get("swa_pool_tokens")
    if not isinstance(swa, int) or longest <= swa:
        return None
    return (f"the longest declared prompt ({longest} tokens) exceeds the SWA KV pool "
            f"({swa} tokens, {SOURCES['swa_pool_tokens']}): such a prompt is never admitted "
            "and its request ends with no token; give the SWA pool a larger share "
            "(serve.extra_args: --swa-full-tokens-ratio, larger than sglang's default) or keep "
            "fewer resident experts (serve.kt_num_gpu_experts) so the pool gets more HBM")
