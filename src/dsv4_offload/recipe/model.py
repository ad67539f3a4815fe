"""The recipe as a whole: the runtime, the platform and the cross-references between
sections, plus where it came from (the file chain and the `--set` items applied)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import (
    Field,
    PrivateAttr,
    model_validator,
)

from dsv4_offload.core.registry import STAGE_NAMES
from dsv4_offload.recipe.accept_section import Acceptance
from dsv4_offload.recipe.fields import Name, Strict, no_duplicates
from dsv4_offload.recipe.sections import (
    Build,
    Conversion,
    Host,
    Selftest,
    Serve,
    Source,
    Tune,
    Weights,
)

# --- recipe --------------------------------------------------------------------------------


class Runtime(Strict):
    """Where the NPU-side stages run: on this host, or in a container of ``image``.

    The container defaults are the delivery's ``scripts/launch_dsv4_singleCard_cann8.5.0_910b.sh``
    (cann-recipes-infer @ 1a7fbd3); each field names its line there.
    """

    kind: Literal["host", "container"] = Field(
        "host", description="container: those stages run in `image` (dsv4-offload container)")
    image: str | None = Field(None, description="launch script line 21 (IMAGE)")
    name: Name = Field("dsv4_singlecard", description="line 22 (NAME)")
    shm_size: str = Field("16g", pattern=r"^\d+[bkmg]?$", description="line 26 (SHM_SIZE)")
    devices: str = Field(
        "auto", pattern=r"^(auto|\d+(,\d+)*)$",
        description="line 27 (NPU_VISIBLE_DEVICES): auto = every /dev/davinciN, or '0,3'")
    mounts: list[str] = Field(
        ["/usr/local/sbin:/usr/local/sbin", "/usr/local/dcmi:/usr/local/dcmi",
         "/usr/local/bin/npu-smi:/usr/local/bin/npu-smi",
         "/usr/local/Ascend/driver/:/usr/local/Ascend/driver/",
         "/usr/local/Ascend/firmware:/usr/local/Ascend/firmware",
         "/etc/ascend_install.info:/etc/ascend_install.info",
         "/var/queue_schedule:/var/queue_schedule"],
        description="lines 46-52: driver, firmware, npu-smi, dcmi, sbin (HOST:CONTAINER)")
    packages: list[str] = Field(
        ["libhwloc-dev", "libhwloc15", "pkg-config"],
        description="apt packages the image lacks (guide G105-108: lost when recreated)")
    python: str = Field(
        "python3.11", description="the image's python: makes this tool's own venv in the "
        "workspace (the server keeps its interpreter and packages)")
    install_timeout: float = Field(
        900, gt=0, description="seconds each install step inside may take (apt, venv, pip "
        "from the host-filled wheelhouse); past it the step fails with the offline way")
    stages: list[str] = Field(
        ["build", "selftest", "serve", "accept"],
        description="stages `run` sends into the container; the others stay on the host")

    @model_validator(mode="after")
    def _image(self) -> Runtime:
        if self.kind == "container" and not self.image:
            raise ValueError("runtime.kind 'container' needs runtime.image, e.g. "
                             "lmsysorg/sglang:deepseek-v4-npu-910b")
        for mount in self.mounts:
            host, sep, inside = mount.partition(":")
            if not sep or not host.startswith("/") or not inside.startswith("/"):
                raise ValueError(f"runtime.mounts: '{mount}' must be /host/path:/container/path")
        return self


class Pipeline(Strict):
    """How a pipelined `run` shares the cores between the build and the conversion that
    runs beside it (the download is bound by the link, not the cores). The jobs are handed
    to the stages as their `jobs` option: convert's `--jobs`; for build, the variables its
    compiles read (kt-kernel's CPUINFER_PARALLEL, CMake's CMAKE_BUILD_PARALLEL_LEVEL), which
    a step's own `env` still overrides."""

    cores: int = Field(
        0, ge=0, description="cores the run may use; 0 = the CPUs this process may run on "
        "(its affinity mask)")
    build_jobs: int = Field(
        0, ge=0, description="parallel compile jobs of `build`; 0 = cores minus "
        "convert_jobs_beside_build (at least 1): the build first, with most cores")
    convert_jobs_beside_build: int = Field(
        1, ge=1, description="conversion jobs while the build is still to finish in the same "
        "run (a following convert is paced by the download: one job keeps up)")
    convert_jobs: int = Field(
        0, ge=0, description="conversion jobs when no build runs beside it; 0 = convert's own "
        "default (its `--jobs` default)")

    @model_validator(mode="after")
    def _fits(self) -> Pipeline:
        if self.cores and self.build_jobs + self.convert_jobs_beside_build > self.cores:
            raise ValueError(
                f"build_jobs {self.build_jobs} + convert_jobs_beside_build "
                f"{self.convert_jobs_beside_build} exceed cores {self.cores}; lower build_jobs "
                "(or leave it 0: the cores convert does not take)")
        return self


class Platform(Strict):
    npu: str = Field(description="NPU family (910B, A3)")
    cann: str = Field(description="CANN version the recipe was made for")
    image: str | None = Field(None, description="container image of the delivery, if any")
    environment: str = Field("", description="the environment the guide brings up, in words")
    cc: str | None = Field(
        None, description="C compiler of the kt-kernel step, its CC (default: gcc); the other "
        "steps keep the environment's")
    cxx: str | None = Field(
        None, description="C++ compiler of the kt-kernel step, its CXX (default: g++)")


@dataclass(frozen=True)
class Origin:
    """Where a loaded recipe came from: its file, the files it extends (its own first), and
    the `--set` items applied, so a stage run elsewhere (the container) loads the same one."""

    file: Path
    chain: tuple[Path, ...]
    overrides: tuple[str, ...] = ()
    # the workspace's tune overlay (`tune apply`) laid on the chain before the --set items,
    # and the dotted keys it sets (for `serve --print`'s origins)
    overlay: Path | None = None
    overlay_keys: tuple[str, ...] = ()


class Recipe(Strict):
    schema_version: Literal[1] = Field(1, alias="schema", description="always `1`")
    name: Name = Field(description="plain name (letters, digits, `.`, `_`, `-`)")
    description: str = Field("", description="a sentence")
    platform: Platform = Field(description="the NPU, CANN version and toolchain")
    series: str = Field(description="bundled series name or a path relative to the recipe")
    delivery: Name = Field(description="the source that holds the series and scripts")
    tree_root: Name = Field(description="the source whose checkout is the workspace tree")
    sources: list[Source] = Field(
        min_length=1,
        description="git repositories pinned at full commits")
    build: Build = Field(description="what `build` compiles")
    weights: Weights = Field(description="the two weight sets `download` fetches")
    conversion: Conversion = Field(description="GGUF conversion of the routed experts")
    serve: Serve = Field(
        description="server flags, environment and the rules that derive values from the host")
    acceptance: Acceptance = Field(description="what `accept` checks")
    host: Host = Field(description="what `doctor` requires of the host")
    selftest: Selftest = Field(
        Selftest(), description="what `selftest` sends through the built kt-kernel")
    series_targets: list[Name] = Field(
        [], description="apply only the series' patches for these sources ([]: all of them); "
        "a recipe without sglang can still take the delivery's whole series")
    series_skip: list[Name] = Field(
        [], description="patches of the series to leave out: only this project's own fixes "
        "(`upstream: local` with a `risk`), e.g. to serve the delivery's series unmodified; "
        "every command that loads the recipe warns with what each one left out risks")
    not_applicable: list[str] = Field(
        [], description="pipeline stages that make no sense for this recipe (e.g. an x86 "
        "development recipe ends at selftest): `run` passes them, running them says why")
    runtime: Runtime = Field(
        Runtime(), description="where build, selftest, serve and accept run: host or container")
    pipeline: Pipeline = Field(
        Pipeline(), description="how a pipelined `run` shares the cores between build and "
        "conversion")
    tune: Tune = Field(Tune(), description="what `tune` searches (the knobs of decode speed)")

    @model_validator(mode="after")
    def _cross_refs(self) -> Recipe:
        names = [s.name for s in self.sources]
        no_duplicates(names, "sources", "name")
        no_duplicates([s.path for s in self.sources], "sources", "path")
        for ref, label in ((self.delivery, "delivery"), (self.tree_root, "tree_root")):
            if ref not in names:
                raise ValueError(f"{label} '{ref}' is not a source name; use one of {names}")
        for s in self.sources:
            if s.submodule_of is not None and s.submodule_of not in names:
                raise ValueError(f"source '{s.name}': submodule_of '{s.submodule_of}' is unknown")
        missing = [t for t in self.series_targets if t not in names]
        if missing:
            raise ValueError(f"series_targets: '{missing[0]}' is not a source name; use one "
                             f"of {names}")
        unknown = [n for n in self.not_applicable if n not in STAGE_NAMES]
        if unknown:
            raise ValueError(f"not_applicable: '{unknown[0]}' is not a stage; stages are "
                             f"{', '.join(STAGE_NAMES)}")
        for step in self.build.steps:
            for name in step.log_sources or []:
                if name not in names:
                    raise ValueError(f"build step '{step.name}': log_sources '{name}' is not a "
                                     f"source name; use one of {names}")
        for key, remote in self.build.files.items():
            if remote.source not in names:
                raise ValueError(f"build.files.{key}.source '{remote.source}' is not a source")
        manifest = self.conversion.digests_manifest
        if manifest and manifest.source not in names:
            raise ValueError("conversion.digests_manifest.source is not a source name")
        return self

    _origin: Origin | None = PrivateAttr(None)  # set once, by recipe.load

    @property
    def origin(self) -> Origin | None:
        return self._origin

    @property
    def file(self) -> Path | None:
        """The recipe's own file (None for a model built in code)."""
        return self._origin.file if self._origin else None

    @property
    def chain(self) -> tuple[Path, ...]:
        return self._origin.chain if self._origin else ()

    @property
    def overrides(self) -> tuple[str, ...]:
        return self._origin.overrides if self._origin else ()

    @property
    def overlay_keys(self) -> tuple[str, ...]:
        """The dotted keys the workspace's tune overlay set (none without one)."""
        return self._origin.overlay_keys if self._origin else ()

    def source(self, name: str) -> Source:
        for s in self.sources:
            if s.name == name:
                return s
        raise KeyError(name)
