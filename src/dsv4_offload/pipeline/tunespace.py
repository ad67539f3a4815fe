"""What `tune` searches: the knobs of decode speed, their values, and the settings the
serve rules forbid (each said with the rule's own words, before any server starts).

A setting maps knob names to values; ``overrides`` turns it into the `--set` items of the
recipe fields it sets, the overlay a trial's server is started with and `tune apply` writes.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dsv4_offload.core.errors import Dsv4Error, InputError
from dsv4_offload.recipe.sections import HOT_TAIL_ENV  # its comment: where the server reads it
from dsv4_offload.serving.rules import (
    cpu_plan,
    cpuinfer_problem,
    dram_advice,
    experts_problem,
    mem_fraction_problem,
    threadpool_problem,
)

if TYPE_CHECKING:
    from dsv4_offload.core.host import HostFacts
    from dsv4_offload.recipe import Recipe


@dataclass(frozen=True)
class Knob:
    """One knob: its name on the command line, the recipe key it sets, what `tune` tries,
    and the value the recipe gives now (the baseline)."""

    name: str
    key: str
    choices: tuple[Any, ...]
    current: Any
    what: str


KNOB_NAMES = ("experts", "mem_fraction", "threadpools", "cpuinfer", "hot_tail")


def knobs(recipe: Recipe, facts: HostFacts, names: Sequence[str] = ()) -> list[Knob]:
    """The knobs to search (``names``, default all), their values from the recipe's `tune`
    section, each holding the recipe's current value too."""
    unknown = [n for n in names if n not in KNOB_NAMES]
    if unknown:
        raise InputError(f"--knob {unknown[0]}: not a knob of tune; use one of "
                         f"{', '.join(KNOB_NAMES)}")
    serve, space = recipe.serve, recipe.tune
    nodes = max(1, len(facts.numa_nodes))
    pools_now, threads_now = _cpus_now(recipe, facts)
    hot_now = int(serve.env.get(HOT_TAIL_ENV, "0") or 0)  # as the server reads it: 0 is off
    pools = space.threadpools or sorted({1, nodes, *[2**i for i in range(8) if 2**i < nodes]})
    every = [
        Knob("experts", "serve.kt_num_gpu_experts", _with(space.experts,
             serve.kt_num_gpu_experts), serve.kt_num_gpu_experts, "resident experts"),
        Knob("mem_fraction", "serve.mem_fraction_static", _with(space.mem_fraction,
             serve.mem_fraction_static), serve.mem_fraction_static, "--mem-fraction-static"),
        Knob("threadpools", "serve.kt_threadpool_count", _with(pools, pools_now), pools_now,
             "kt-kernel subpools"),
        Knob("cpuinfer", "serve.kt_cpuinfer", _with(space.cpuinfer, threads_now), threads_now,
             "CPU-infer threads"),
        Knob("hot_tail", f"serve.env.{HOT_TAIL_ENV}", _with(space.hot_tail_tokens, hot_now),
             hot_now, "hot-tail window (tokens)"),
    ]
    chosen = set(names or KNOB_NAMES)
    return [k for k in every if k.name in chosen]


def _with(values: Sequence[Any], current: Any) -> tuple[Any, ...]:
    return tuple(sorted({*values, current}))


def _cpus_now(recipe: Recipe, facts: HostFacts) -> tuple[int, int]:
    """The pools and threads serve would take now: the recipe's, else the host rule's."""
    serve = recipe.serve
    try:
        plan = cpu_plan(serve, facts.numa_nodes, facts.cores, serve.kt_threadpool_count)
    except Dsv4Error:  # a host too small for one thread per pool: its own error at serve
        return serve.kt_threadpool_count or 1, serve.kt_cpuinfer or 1
    return plan.pools, serve.kt_cpuinfer or plan.threads


def full(setting: Mapping[str, Any], space: Sequence[Knob]) -> dict[str, Any]:
    """``setting`` with every knob it leaves out at the recipe's current value."""
    return {k.name: setting.get(k.name, k.current) for k in space}


def overrides(setting: Mapping[str, Any], space: Sequence[Knob]) -> dict[str, Any]:
    """The recipe keys a setting sets (dotted), with their values."""
    by_name = {k.name: k for k in space}
    out: dict[str, Any] = {}
    for name, value in setting.items():
        knob = by_name[name]
        out[knob.key] = str(value) if knob.key.startswith("serve.env.") else value
    return out


def set_items(setting: Mapping[str, Any], space: Sequence[Knob]) -> list[str]:
    """The setting as `--set KEY=VALUE` items."""
    return [f"{key}={value}" for key, value in overrides(setting, space).items()]


def forbidden(recipe: Recipe, facts: HostFacts, setting: Mapping[str, Any],
              device: int | None = None) -> str | None:
    """Why the serve rules forbid ``setting`` on this host, or None: the HBM ceiling of
    resident experts, the MEM_FRACTION rule, the card's free HBM, the pools per NUMA node,
    the threads per core, the DRAM the pool count needs. Each reason is the rule's own.
    A knob the setting leaves out is at the recipe's current value."""
    value = full(setting, knobs(recipe, facts))
    serve = recipe.serve
    problem = experts_problem(serve, int(value["experts"]))
    if problem:
        return f"experts {value['experts']}: {problem}"
    fraction = float(value["mem_fraction"])
    streaming = os.environ.get("KT_PREFILL_STREAM") or serve.env.get("KT_PREFILL_STREAM")
    problem = mem_fraction_problem(serve, fraction, streaming == "1")
    if problem:
        return problem
    cards = [n for n in facts.npus if n.healthy and (device is None or n.device_id == device)]
    if cards and not any(_hbm_free(n, fraction) for n in cards):
        return (f"--mem-fraction-static {fraction:g}: no healthy card has that share of its "
                "HBM free (npu-smi); free the card or lower the fraction")
    nodes = max(1, len(facts.numa_nodes))
    pools, threads = int(value["threadpools"]), int(value["cpuinfer"])
    problem = threadpool_problem(pools, nodes)
    if problem:
        return f"threadpools {pools}: {problem}"
    problem = cpuinfer_problem(threads, pools, facts.cores, serve.reserved_cores)
    if problem:
        return f"cpuinfer {threads}: {problem}"
    if facts.mem_available_kib is not None:
        # 'warn' too: the page cache thrashing under it makes a trial of no use
        verdict, said = dram_advice(recipe, pools, facts.mem_available_kib / 2**20)
        if verdict != "ok":
            return f"threadpools {pools}: DRAM: {said}"
    return None


def _hbm_free(npu: Any, fraction: float) -> bool:
    from dsv4_offload.core.host import npu_is_idle

    return npu.hbm_total_mb is None or npu_is_idle(npu, fraction)


def grid(space: Sequence[Knob]) -> Iterator[dict[str, Any]]:
    """Every setting of the space, in a fixed order."""
    for values in itertools.product(*(k.choices for k in space)):
        yield dict(zip((k.name for k in space), values, strict=True))


def key_of(setting: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    """A setting's identity, for "measured already?"."""
    return tuple(sorted((k, repr(v)) for k, v in setting.items()))
