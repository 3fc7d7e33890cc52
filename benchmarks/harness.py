"""The benchmark suite's machinery: the scenario registry, result rows, ratios, and the JSON document.

A scenario is one function that takes a `Context` and returns `Row`s; it is
registered with the `@scenario` decorator in a module listed in
SCENARIO_MODULES. Adding one is a one-function affair:

    from benchmarks.harness import Context, Row, scenario

    @scenario("lookups", help="embedding lookups vs nn.EmbeddingBag")
    def lookups(ctx: Context) -> list[Row]:
        with ctx.rss(server_pids) as peaks:          # peak RSS of those processes meanwhile
            seconds = ...                            # time the thing (ctx.quick: make it small)
        return [Row("lookups", case="1M ids", name="shardserve", path="grpc", seconds=seconds,
                    baseline="nn.EmbeddingBag", peak_rss=peaks),
                Row("lookups", case="1M ids", name="nn.EmbeddingBag", role="baseline", seconds=...)]

Rows of one (group, case) are compared with each other: every row gets
`ratio` = baseline seconds / its seconds (> 1 means faster than the baseline)
against the row its `baseline` names (default: the first row of the case with
role "baseline"), and `ratios` against every baseline row of the case.
Name processes with `ctx.sampler.label(pid, "rank 0 server")` so that the
peak-RSS report says whose memory it is.
"""

from __future__ import annotations

import importlib
import logging
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from benchmarks.machine import machine_info
from benchmarks.rss import RssSampler

if TYPE_CHECKING:
    from shardserve.server.coordinator.options import CoordinatorOptions

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
CLUSTER_START_TIMEOUT_S = 180.0
DEAD_AFTER_S = 10.0
"""Heartbeats missed this long mark a rank of a benchmark's cluster dead. Benchmarks time data paths, not
liveness (a killed rank is reported by its supervisor at once): on a loaded 2-core host a live rank's heartbeats
can be seconds late, and the default (twice the 1 s interval) took both ranks of a smoke run for dead and
refused its put."""
SCENARIO_MODULES = (
    "benchmarks.fetch",
    "benchmarks.scenarios",
    "benchmarks.embedding",
    "benchmarks.cuda",
    "benchmarks.security",
    "benchmarks.statedict",
    "benchmarks.persist",
    "benchmarks.torchrec_serving",
    "benchmarks.scale",
)
ROLES = ("subject", "baseline")


@dataclass(frozen=True)
class Target:
    """What a row is asked to reach, reported beside it and never asserted: at least `min_ratio` (its
    baseline's seconds over its own; "within 3x of the baseline" is 1/3), or at most `max_seconds`."""

    min_ratio: float | None = None
    max_seconds: float | None = None

    def __post_init__(self) -> None:
        if (self.min_ratio is None) == (self.max_seconds is None):
            raise ValueError("a target is either min_ratio or max_seconds")
        if not (self.min_ratio or self.max_seconds or 0) > 0:
            raise ValueError(f"a target must be > 0, got {self}")

    @property
    def text(self) -> str:
        if self.max_seconds is not None:
            return f"<= {self.max_seconds * 1e3:g} ms"
        assert self.min_ratio is not None
        slowdown = 1 / self.min_ratio
        if slowdown > 1 and abs(slowdown - round(slowdown)) < 1e-9:  # asked as "within Nx"
            return f">= {self.min_ratio:.2f}x (within {round(slowdown)}x)"
        return f">= {self.min_ratio:.2f}x"

    def met(self, seconds: float | None, ratio: float | None) -> bool | None:
        """Whether a row with these figures reaches the target; None when it has no figure to judge."""
        if self.max_seconds is not None:
            return None if seconds is None else seconds <= self.max_seconds
        return None if ratio is None else ratio >= (self.min_ratio or 0)


@dataclass
class Row:
    """One measured method in one case of a scenario group; `seconds` None means it did not run (see note)."""

    group: str
    case: str
    name: str
    seconds: float | None
    path: str | None = None
    role: str = "subject"
    nbytes: int | None = None
    baseline: str | None = None
    peak_rss: dict[str, int] = field(default_factory=dict)
    ok: bool | None = None
    note: str = ""
    extra: dict = field(default_factory=dict)
    target: Target | None = None
    scenario: str = ""
    ratio: float | None = None
    ratios: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        for name in ("group", "case", "name"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"{name} must be a non-empty string, got {getattr(self, name)!r}")
        if self.seconds is not None and not self.seconds > 0:
            raise ValueError(f"seconds must be > 0 or None, got {self.seconds!r}")

    @property
    def gb_per_s(self) -> float | None:
        """Bytes moved per second, in GB/s (10^9), when the row moves bytes."""
        if self.seconds is None or not self.nbytes:
            return None
        return self.nbytes / self.seconds / 1e9

    @property
    def target_met(self) -> bool | None:
        """Whether the row reaches its target (None: no target, or no figure)."""
        return None if self.target is None else self.target.met(self.seconds, self.ratio)

    def to_json(self) -> dict:
        out = asdict(self)
        out["gb_per_s"] = self.gb_per_s
        out["peak_rss_max_bytes"] = max(self.peak_rss.values(), default=None)
        if self.target is not None:
            out["target"].update(text=self.target.text, met=self.target_met)
        return out


def failure_row(group: str, case: str, name: str, error: BaseException, **fields) -> Row:
    """A row for a method that raised: no figure, its error's first line as the note (the run goes on)."""
    first = (str(error).strip().splitlines() or [""])[0][:160]
    return Row(group, case, name, None, note=f"failed: {type(error).__name__}: {first}", **fields)


@dataclass
class Context:
    """What a scenario gets: the quick flag, the RSS sampler, and the rank counts and shards asked for (`--ranks`,
    `--shards`; None: the scenario's own)."""

    quick: bool
    sampler: RssSampler
    ranks: tuple[int, ...] | None = None
    shards: int | None = None

    def rss(self, pids: Iterable[int] | None = None):
        """Context manager yielding {label: peak RSS bytes} of `pids` (default all processes) while it is open."""
        return self.sampler.window(pids)

    def start_cluster(
        self,
        stack: ExitStack,
        ranks: int,
        timeout: float = CLUSTER_START_TIMEOUT_S,
        device: str = "cpu",
        **options,
    ):
        """A LocalCluster of `ranks` in a temporary state dir (`options`: more LocalCluster arguments, e.g.
        security; its coordinator's by default `coordinator_options()`), stopped when `stack` closes, its ranks
        labelled for the RSS sampler."""
        # imported here: the harness itself stays free of torch and gRPC
        from shardserve.server.common.rank_options import RankOptions
        from shardserve.server.launcher import LocalCluster

        state = stack.enter_context(tempfile.TemporaryDirectory(prefix="shardserve-bench-"))
        rank_options = RankOptions(log_level="WARNING", device=device)
        options.setdefault("start_method", "forkserver")  # as `shardserve up` starts its ranks
        options.setdefault("coordinator_options", coordinator_options())
        cluster = LocalCluster(ranks, state_dir=state, rank_options=rank_options, **options)
        stack.callback(cluster.stop)
        cluster.start(timeout=timeout)
        for rank, pid in enumerate(cluster.rank_pids):
            self.sampler.label(pid, f"rank {rank} server")
        return cluster


def coordinator_options() -> CoordinatorOptions:
    """The coordinator options of a benchmark's LocalCluster: a rank dead after DEAD_AFTER_S of silence."""
    from shardserve.server.coordinator.options import CoordinatorOptions

    return CoordinatorOptions(dead_after=DEAD_AFTER_S)


@dataclass(frozen=True)
class Scenario:
    name: str
    run: Callable[[Context], list[Row]]
    help: str


REGISTRY: dict[str, Scenario] = {}


def scenario(
    name: str, help: str = ""
) -> Callable[[Callable[[Context], list[Row]]], Callable[[Context], list[Row]]]:
    """Register `fn(ctx) -> list[Row]` as the scenario `name`."""
    if not isinstance(name, str) or not name or " " in name:
        raise ValueError(f"scenario name must be a non-empty word, got {name!r}")

    def register(fn: Callable[[Context], list[Row]]) -> Callable[[Context], list[Row]]:
        if name in REGISTRY and not _same_function(REGISTRY[name].run, fn):
            raise ValueError(f"scenario {name!r} is registered twice")
        REGISTRY[name] = Scenario(
            name, fn, help or next(iter((fn.__doc__ or "").strip().splitlines()), "")
        )
        return fn

    return register


def _same_function(a: Callable, b: Callable) -> bool:
    """Whether a and b are one source function (a module run as __main__ and imported again gives two)."""
    return a is b or (
        a.__qualname__ == b.__qualname__ and a.__code__.co_filename == b.__code__.co_filename
    )


def load_scenarios() -> dict[str, Scenario]:
    """Import every scenario module (they register themselves) and return the registry."""
    for module in SCENARIO_MODULES:
        importlib.import_module(module)
    return REGISTRY


def fill_ratios(rows: list[Row]) -> None:
    """Set `ratio` and `ratios` of every row against the baselines of its (group, case)."""
    cases: dict[tuple[str, str], list[Row]] = {}
    for row in rows:
        cases.setdefault((row.group, row.case), []).append(row)
    for members in cases.values():
        baselines = {r.name: r for r in members if r.role == "baseline"}
        default = next(iter(baselines), None)
        for row in members:
            row.baseline = row.baseline or default
            row.ratios = {
                name: base.seconds / row.seconds
                for name, base in baselines.items()
                if base is not row and base.seconds and row.seconds
            }
            reference = baselines.get(row.baseline) if row.baseline else None
            if reference is not None and reference.seconds and row.seconds:
                row.ratio = reference.seconds / row.seconds


def run_scenarios(
    names: Iterable[str],
    quick: bool,
    ranks: tuple[int, ...] | None = None,
    *,
    shards: int | None = None,
) -> tuple[list[Row], list[dict]]:
    """Run the named scenarios one after another; a failing scenario is reported, not fatal."""
    rows: list[Row] = []
    reports: list[dict] = []
    with RssSampler() as sampler:
        ctx = Context(quick=quick, sampler=sampler, ranks=ranks, shards=shards)
        for name in names:
            entry = REGISTRY[name]
            start = time.perf_counter()
            report = {"name": name, "help": entry.help, "status": "ok", "error": None}
            try:
                produced = entry.run(ctx)
            except Exception as exc:
                log.error("scenario %s failed:\n%s", name, traceback.format_exc())
                produced = []
                report.update(status="failed", error=f"{type(exc).__name__}: {exc}")
            for row in produced:
                row.scenario = name
            rows += produced
            report["wall_seconds"] = time.perf_counter() - start
            report["rows"] = len(produced)
            reports.append(report)
    fill_ratios(rows)
    return rows, reports


def document(
    rows: list[Row], reports: list[dict], quick: bool, command: str, machine: dict | None = None
) -> dict:
    """The JSON document of one suite run."""
    return {
        "schema": SCHEMA_VERSION,
        "command": command,
        "quick": quick,
        "machine": machine if machine is not None else machine_info(),
        "scenarios": reports,
        "rows": [row.to_json() for row in rows],
    }
