"""The stage registry: every pipeline stage, what it needs, what feeds its fingerprint.

One row per stage. The stage's code is the module ``dsv4_offload.stages.<name>`` (dashes
become underscores) with one entry point, ``run(ctx) -> StageResult``; the pipeline imports
it only when the stage runs. Adding a stage is a row here, its module and its test.

A stage module that can follow a need listed in its row's ``streams`` while that need still
runs (convert, converting each layer as its shards arrive) says so with ``FOLLOWS = True``;
a pipelined `run` then starts it beside that need with the option ``follow=True``. Without
it the stage waits for the need to be done, as any other.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from dsv4_offload.core.errors import InputError


@dataclass(frozen=True)
class StageSpec:
    name: str
    needs: tuple[str, ...]
    recipe_fields: tuple[str, ...]  # dotted recipe paths whose values feed the fingerprint
    exclude: tuple[str, ...] = ()  # dotted paths (prefixes) left out of those
    summary: str = ""
    run_options: dict[str, Any] = field(default_factory=dict)  # options when run by `run`
    # needs a pipelined `run` may start beside, before they are done: the stage follows
    # their progress itself (convert converts each layer as its shards arrive)
    streams: tuple[str, ...] = ()
    # order only (no fingerprint): a pipelined `run` starts the stage once these are over
    # and did not fail, as the serial order has it (doctor before any transfer, the
    # self-test before the server)
    after: tuple[str, ...] = ()

    @property
    def module(self) -> str:
        # DSV4_STAGE_PACKAGE swaps in another implementation of the stages (a site's own
        # stage package, or the test suite's instrumented ones); the pipeline stays the same
        package = os.environ.get("DSV4_STAGE_PACKAGE", "dsv4_offload.stages")
        return f"{package}.{self.name.replace('-', '_')}"


STAGES: tuple[StageSpec, ...] = (
    StageSpec("doctor", (), ("host",), summary="host preflight"),
    StageSpec("fetch", (), ("sources",), summary="sources at their pinned commits",
              after=("doctor",)),
    StageSpec("patch", ("fetch",), ("series",), summary="the patch series as commits"),
    # a build made in another image (or on the host instead of in one) is not this one
    StageSpec("build", ("patch",), ("build", "platform", "runtime.kind", "runtime.image"),
              summary="kt-kernel, gguf-py, sglang"),
    # before the downloads: a bad build stops `run` before hours of transfers
    StageSpec("selftest", ("build",), ("selftest",),
              exclude=("selftest.real_layer.enabled", "selftest.real_layer.layer"),
              summary="kt-kernel MXFP4 MoE vs a numpy reference"),
    # how many files travel at once changes no byte of the result
    StageSpec("download", (), ("weights",), exclude=("weights.streams",),
              summary="W8A8 and MXFP4 weights", after=("doctor",)),
    StageSpec(
        "convert",
        ("download",),
        ("conversion",),
        streams=("download",),
        exclude=("conversion.digests", "conversion.digests_manifest",
                 "conversion.expected_file_bytes"),
        summary="MXFP4 experts into per-layer GGUF",
    ),
    StageSpec("verify-gguf", ("convert",), ("conversion", "selftest.real_layer"),
              summary="sizes, digests, bit-exact, a layer through kt-kernel"),
    StageSpec(
        "serve",
        ("build", "verify-gguf"),
        ("serve", "weights.w8a8.dir", "conversion.gguf_dir", "conversion.file_template",
         "acceptance.throughput.server_chunk"),
        summary="the hybrid server, supervised",
        after=("selftest",),  # a kt-kernel that failed its self-test is not served
        # `run` goes on to accept: a chunk that takes its longest bucket (guide §7, §8.1)
        run_options={"detach": True, "accept_chunk": True},
    ),
    StageSpec("accept", ("serve",), ("acceptance",), summary="coherence, log markers, tok/s"),
)
STAGE_NAMES = tuple(s.name for s in STAGES)


def spec(name: str) -> StageSpec:
    for s in STAGES:
        if s.name == name:
            return s
    raise InputError(f"unknown stage '{name}'; stages are: {', '.join(STAGE_NAMES)}")
