"""The stage registry: every pipeline stage, what it needs, what feeds its fingerprint.

One row per stage. The stage's code is the module ``dsv4_offload.stages.<name>`` (dashes
become underscores) with one entry point, ``run(ctx) -> StageResult``; the pipeline imports
it only when the stage runs. Adding a stage is a row here, its module and its test.

A stage module that can follow a need listed in its row's ``streams`` while that need still
runs (convert, converting each layer as its shards arrive) says so with ``FOLLOWS = True``;
a pipelined `run` then starts it beside that need with the option ``follow=True``. Without
it the stage waits for the need to be done, as any other.

The row also tells the generic parts what they need, so none of them names a stage: its CPU
class (the scheduler's jobs), the disk sets it writes (the run's disk preflight), the recipe
list its plan shows as steps, its branch and progress in the live and in-flight views.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from dsv4_offload.core.errors import InputError


class Cpu(str, Enum):
    """What a stage takes of the cores when a pipelined `run` starts it (its ``jobs``)."""

    NONE = "none"  # no jobs option: it uses what it uses
    # the compile budget (pipeline.build_jobs: the cores the yielding stages leave)
    COMPILE = "compile"
    # pipeline.convert_jobs_beside_build while a COMPILE stage of this run is still to
    # finish, pipeline.convert_jobs (0: its own default) once none is
    YIELDS = "yields"


class View(str, Enum):
    """What the in-flight view reads as the stage's progress (any stage: its latest task)."""

    TASK = "task"
    # bytes, rate and ETA per disk set: its tasks named "<stage> <set>"
    SETS = "sets"
    # layers converted and verified (its layer.* events); paces the projected ready time
    LAYERS = "layers"


@dataclass(frozen=True)
class DiskSet:
    """A set of files a stage writes, counted by the disk preflight of a pipelined `run`:
    where it goes and how big it gets, both read from the recipe."""

    name: str
    directory: str  # dotted recipe path of its directory (relative: under the workspace)
    size: tuple[str, ...]  # dotted recipe paths whose product is its expected bytes


W8A8 = DiskSet("w8a8", "weights.w8a8.dir", ("weights.w8a8.expected_bytes",))
MXFP4 = DiskSet("mxfp4", "weights.mxfp4.dir", ("weights.mxfp4.expected_bytes",))
GGUF = DiskSet("gguf", "conversion.gguf_dir",
               ("conversion.layers", "conversion.expected_file_bytes"))


@dataclass(frozen=True)
class StageSpec:
    name: str
    needs: tuple[str, ...]
    recipe_fields: tuple[str, ...]  # dotted recipe paths whose values feed the fingerprint
    exclude: tuple[str, ...] = ()  # dotted paths (prefixes) left out of those
    # dotted paths (prefixes) it reads that are not among those, and rightly: its module's
    # fingerprint_inputs judges what they make of the host or the tree (doctor's checks,
    # build's interpreter); tests/recipe_reads.py holds every row to what its stage reads
    reads: tuple[str, ...] = ()
    summary: str = ""
    run_options: dict[str, Any] = field(default_factory=dict)  # options when run by `run`
    # needs a pipelined `run` may start beside, before they are done: the stage follows
    # their progress itself (convert converts each layer as its shards arrive)
    streams: tuple[str, ...] = ()
    # order only (no fingerprint): a pipelined `run` starts the stage once these are over
    # and did not fail, as the serial order has it (doctor before any transfer, the
    # self-test before the server)
    after: tuple[str, ...] = ()
    cpu: Cpu = Cpu.NONE
    disk_sets: tuple[DiskSet, ...] = ()
    # dotted recipe path of a list of named items: the plan shows their names as its steps
    steps: str = ""
    branch: str = ""  # the live view's group of it (empty: a group of its own)
    view: View = View.TASK
    # its result's rows are declared checks (core/preflight): a failed row stops only the
    # stages it guards and those the run runs to feed them
    preflight: bool = False

    @property
    def module(self) -> str:
        # DSV4_STAGE_PACKAGE swaps in another implementation of the stages (a site's own
        # stage package, or the test suite's instrumented ones); the pipeline stays the same
        package = os.environ.get("DSV4_STAGE_PACKAGE", "dsv4_offload.stages")
        return f"{package}.{self.name.replace('-', '_')}"


# what any stage may read that is no input of its result: the recipe's labels, and the
# stages the recipe leaves out (the pipeline's to judge, before a stage runs)
LABELS = ("name", "description", "not_applicable")

STAGES: tuple[StageSpec, ...] = (
    # it judges every stage's requirements of the host; its fingerprint_inputs digests the
    # outcome of every check, so what it reads of the rest of the recipe reaches it there
    StageSpec("doctor", (), ("host",), summary="host preflight", branch="host", preflight=True,
              reads=("build", "conversion", "platform", "runtime", "selftest", "serve",
                     "sources", "tree_root", "weights")),
    StageSpec("fetch", (), ("sources",), summary="sources at their pinned commits",
              after=("doctor",), branch="build"),
    StageSpec("patch", ("fetch",), ("series",), summary="the patch series as commits",
              branch="build"),
    # a build made in another image (or on the host instead of in one) is not this one
    # host.python: the interpreter it must be; the one it used is in its fingerprint_inputs
    StageSpec("build", ("patch",), ("build", "platform", "runtime.kind", "runtime.image"),
              summary="kt-kernel, gguf-py, sglang", cpu=Cpu.COMPILE, steps="build.steps",
              branch="build", reads=("host.python",)),
    # before the downloads: a bad build stops `run` before hours of transfers
    # `selftest --bench` (an option, never part of the record's inputs) reads the real dims
    # and the serve plan's pools
    StageSpec("selftest", ("build",), ("selftest",),
              exclude=("selftest.real_layer.enabled", "selftest.real_layer.layer"),
              summary="kt-kernel MXFP4 MoE vs a numpy reference", branch="build",
              reads=("conversion", "serve.cpuinfer_default", "serve.reserved_cores",
                     "serve.threads_per_numa")),
    # how many files travel at once changes no byte of the result
    StageSpec("download", (), ("weights",), exclude=("weights.streams",),
              summary="W8A8 and MXFP4 weights", after=("doctor",), disk_sets=(W8A8, MXFP4),
              branch="weights", view=View.SETS),
    StageSpec(
        "convert",
        ("download",),
        ("conversion",),
        streams=("download",),
        exclude=("conversion.digests", "conversion.digests_manifest",
                 "conversion.expected_file_bytes"),
        summary="MXFP4 experts into per-layer GGUF",
        cpu=Cpu.YIELDS, disk_sets=(GGUF,), branch="weights", view=View.LAYERS,
    ),
    # where the built kt-kernel is: its fingerprint_inputs has the extension's files
    # level 4 runs a layer through kt-kernel as the self-test does: by its API and, for an
    # aarch64 build on x86, under its emulator
    StageSpec("verify-gguf", ("convert",),
              ("conversion", "selftest.real_layer", "selftest.api", "selftest.emulator"),
              summary="sizes, digests, bit-exact, a layer through kt-kernel", branch="weights",
              # sources: where the delivery's digest manifest is checked out; its content is
              # pinned by conversion.digests_manifest.sha256, a fingerprint input already;
              # the built extension (under tree_root, by build.python) is judged by
              # fingerprint_inputs (build/moerun.module_fingerprint)
              reads=("build.python", "build.steps", "selftest.module_dir", "sources",
                     "tree_root")),
    StageSpec(
        "serve",
        ("build", "verify-gguf"),
        # host: the NPU models it may pick a card of, the DRAM margin it keeps
        ("serve", "host", "weights.w8a8.dir", "conversion.gguf_dir", "conversion.file_template",
         "acceptance.throughput.server_chunk"),
        summary="the hybrid server, supervised",
        after=("selftest",),  # a kt-kernel that failed its self-test is not served
        # `run` goes on to accept: a chunk that takes its longest bucket (guide §7, §8.1)
        run_options={"detach": True, "accept_chunk": True},
        branch="server",
    ),
    StageSpec("accept", ("serve",), ("acceptance",), summary="coherence, log markers, tok/s",
              branch="server"),
)
STAGE_NAMES = tuple(s.name for s in STAGES)


def spec(name: str) -> StageSpec:
    for s in STAGES:
        if s.name == name:
            return s
    raise InputError(f"unknown stage '{name}'; stages are: {', '.join(STAGE_NAMES)}")


def recipe_value(recipe: Any, dotted: str) -> Any:
    """The value at a dotted recipe path of a row (``weights.w8a8.dir``)."""
    node = recipe
    for part in dotted.split("."):
        node = getattr(node, part)
    return node
