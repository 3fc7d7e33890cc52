"""Scenario "torchrec": a DLRM-like model's sparse part served by the cluster (shardserve.torchrec).

Eight tables of 100,000-1,000,000 rows, dims 16-128, row-wise over a 2-rank
LocalCluster: six unweighted tables (two of them looked up by two features)
in one EmbeddingBagCollection, two weighted ones in another; pooling factors
1-20 per feature; Zipf(1.05) ids. One forward of both collections per batch,
by three methods, each in client processes of their own:

- RemoteEmbeddingBagCollection (the subject): every table's bags of a batch
  in one lookup round per rank;
- the same bags feature by feature with RemoteEmbeddingBag (the KJT split
  once with to_dict, then one lookup per feature; the same pooling on the
  mapped shards), baseline "feature by feature";
- TorchRec's own EmbeddingBagCollection forward on the weights loaded into
  the process (the lower bound), baseline "local EBC".

The weights are drawn by each table config's init_fn (TorchRec's uniform), so
every method's answer is checked against the local EBC's on real values.

Cases: batch 512 and 2,048; shared memory ("auto": the ranks are on this
host) and the bulk TCP port ("bulk"); 1 client process (seconds: p50 latency
per batch) and 8 client processes at once (seconds: wall time per batch of
all of them, i.e. 1 / batches per second). Notes give p50/p99 and batches/s.
--quick: tables 10x smaller, batch 256, 1 and 2 processes, few batches.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from benchmarks.embedding import ZIPF_S, p
from benchmarks.harness import Context, Row, scenario
from shardserve.server.rank_start import forkserver_context

# (table, rows, dim, features and their pooling factors, weighted)
TABLES = [
    ("t0", 1_000_000, 16, {"f0": 20, "f1": 5}, False),
    ("t1", 100_000, 128, {"f2": 1}, False),
    ("t2", 500_000, 32, {"f3": 10, "f4": 2}, False),
    ("t3", 200_000, 64, {"f5": 5}, False),
    ("t4", 100_000, 16, {"f6": 1}, False),
    ("t5", 300_000, 64, {"f7": 15}, False),
    ("w0", 100_000, 128, {"g0": 8}, True),
    ("w1", 200_000, 32, {"g1": 3}, True),
]
RANKS = 2
PATHS = {"shm": "auto", "bulk": "bulk"}
SUBJECT, BY_FEATURE, LOCAL = "RemoteEmbeddingBagCollection", "feature by feature", "local EBC"
START_TIMEOUT_S, RUN_TIMEOUT_S = 600.0, 600.0


def sizes(quick: bool) -> dict[str, Any]:
    if quick:
        return {"scale": 10, "batches": (256,), "clients": (1, 2), "count": 8}
    return {"scale": 1, "batches": (512, 2048), "clients": (1, 8), "count": 30}


def configs(scale: int, weighted: bool) -> list:
    from torchrec import EmbeddingBagConfig

    return [
        EmbeddingBagConfig(
            name=name, num_embeddings=rows // scale, embedding_dim=dim, feature_names=list(features)
        )
        for name, rows, dim, features, w in TABLES
        if w == weighted
    ]


def models(scale: int) -> dict[str, Any]:
    """The two collections, unweighted and weighted (meta tensors: weights are assigned or uploaded after)."""
    from torchrec import EmbeddingBagCollection

    return {
        kind: EmbeddingBagCollection(
            tables=configs(scale, kind == "weighted"),
            is_weighted=kind == "weighted",
            device=torch.device("meta"),
        )
        for kind in ("plain", "weighted")
    }


def init_weights(module: Any) -> None:
    """Each table's weight drawn by its config's init_fn (TorchRec's uniform). reset_parameters() does nothing
    on a collection built on the meta device, which would serve to_empty's uninitialized (all-zero) pages."""
    with torch.no_grad():
        for config in module.embedding_bag_configs():
            config.init_fn(module.embedding_bags[config.name].weight)


def make_batches(scale: int, batch: int, count: int, seed: int) -> list[dict[str, dict]]:
    """`count` batches: per collection, the KJT's keys, lengths (1..pooling factor), Zipf ids, weights."""
    generator = torch.Generator().manual_seed(seed)
    out: list[dict[str, dict]] = [{} for _ in range(count)]
    for kind in ("plain", "weighted"):
        tables = [t for t in TABLES if t[4] == (kind == "weighted")]
        keys = [f for t in tables for f in t[3]]
        parts: list[dict[str, Any]] = [{"keys": keys, "lengths": [], "values": []} for _ in out]
        for _, rows, _, features, _ in tables:
            hot = torch.arange(1, rows // scale + 1, dtype=torch.float64).pow(-ZIPF_S)
            permutation = torch.randperm(rows // scale, generator=generator)
            for factor in features.values():
                for part in parts:
                    lengths = torch.randint(1, factor + 1, (batch,), generator=generator)
                    ids = torch.multinomial(hot, int(lengths.sum()), True, generator=generator)
                    part["lengths"].append(lengths)
                    part["values"].append(permutation[ids])
        for number, part in enumerate(parts):
            values = torch.cat(part["values"])
            out[number][kind] = {
                "keys": keys,
                "lengths": torch.cat(part["lengths"]),
                "values": values,
                "weights": torch.rand(values.numel(), generator=generator)
                if kind == "weighted"
                else None,
            }
    return out


def kjt(part: dict) -> Any:
    from torchrec import KeyedJaggedTensor

    return KeyedJaggedTensor(
        keys=part["keys"], values=part["values"], lengths=part["lengths"], weights=part["weights"]
    )


# ---------------------------------------------------------------- client processes


def _local_models(model_file: str, scale: int) -> dict[str, Any]:
    state = torch.load(model_file)
    built = models(scale)
    for kind, module in built.items():
        module.load_state_dict(state[kind], assign=True)
    return built


def _forward(method: str, address: str, transport: str, local: dict, scale: int) -> Any:
    """A function batch -> {collection: pooled values} by `method`."""
    if method == LOCAL:
        return lambda batch: {kind: local[kind](kjt(batch[kind])).values() for kind in batch}
    from shardserve import RemoteEmbeddingBag, connect
    from shardserve.torchrec import RemoteEmbeddingBagCollection

    cluster = connect(address, transport=transport)
    if method == SUBJECT:
        remote = {
            kind: RemoteEmbeddingBagCollection(
                cluster, configs(scale, kind == "weighted"), "bench", is_weighted=kind == "weighted"
            )
            for kind in local
        }
        return lambda batch: {kind: remote[kind](kjt(batch[kind])).values() for kind in batch}
    bags = {
        feature: RemoteEmbeddingBag(cluster, f"bench/{name}", mode="sum")
        for name, _, _, features, _ in TABLES
        for feature in features
    }

    def by_feature(batch: dict) -> dict[str, torch.Tensor]:
        """The KJT split once (TorchRec's to_dict), then one RemoteEmbeddingBag call per feature."""
        pooled = {}
        for kind, part in batch.items():
            columns = [
                bags[key](bag.values(), bag.offsets()[:-1], bag.weights_or_none())
                for key, bag in kjt(part).to_dict().items()
            ]
            pooled[kind] = torch.cat(columns, dim=1)
        return pooled

    return by_feature


def _worker(address: str, model_file: str, scale: int, jobs: Any, results: Any) -> None:
    """Run the jobs it is given, (method, transport, batches file): checked, warmed up, "ready", then on "go"
    timed -> (latencies, start, end, ok)."""
    torch.set_num_threads(1)
    local = _local_models(model_file, scale)
    runners: dict[tuple[str, str], Any] = {}
    while (job := jobs.get()) is not None:
        method, transport, batches_file = job
        key = (method, transport)
        if key not in runners:
            runners[key] = _forward(method, address, transport, local, scale)
        run = runners[key]
        batches = torch.load(batches_file)
        want = {k: local[k](kjt(batches[0][k])).values().clone() for k in local}
        got = {k: v.clone() for k, v in run(batches[0]).items()}
        ok = all(torch.allclose(got[k], want[k], rtol=1e-5, atol=1e-6) for k in want)
        run(batches[1])
        results.put("ready")
        if jobs.get() != "go":
            raise RuntimeError("a client process was told something other than go")
        first, latencies = time.monotonic(), []
        for batch in batches:
            begun = time.perf_counter()
            run(batch)
            latencies.append(time.perf_counter() - begun)
        results.put((latencies, first, time.monotonic(), ok))


class Clients:
    """Client processes that stay up for the whole scenario (TorchRec takes seconds to import)."""

    def __init__(self, count: int, address: str, model_file: str, scale: int) -> None:
        self.context = forkserver_context()
        self.results = self.context.Queue()
        self.jobs = [self.context.Queue() for _ in range(count)]
        self.procs = [
            self.context.Process(
                target=_worker, args=(address, model_file, scale, jobs, self.results), daemon=True
            )
            for jobs in self.jobs
        ]
        for proc in self.procs:
            proc.start()

    def run(self, clients: int, method: str, transport: str, batches_file: str) -> dict:
        """Every one of `clients` processes through the batches at once: p50/p99 latency, batches/s, ok."""
        for jobs in self.jobs[:clients]:
            jobs.put((method, transport, batches_file))
        for _ in range(clients):
            if self.results.get(timeout=START_TIMEOUT_S) != "ready":
                raise RuntimeError("a client process answered out of turn")
        for jobs in self.jobs[:clients]:
            jobs.put("go")
        answers = [self.results.get(timeout=RUN_TIMEOUT_S) for _ in range(clients)]
        latencies = [s for answer in answers for s in answer[0]]
        wall = max(a[2] for a in answers) - min(a[1] for a in answers)
        return {
            "p50": statistics.median(latencies),
            "p99": p(latencies, 0.99),
            "batches_per_s": len(latencies) / wall,
            "ok": all(a[3] for a in answers),
        }

    def close(self) -> None:
        for jobs in self.jobs:
            jobs.put(None)
        for proc in self.procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()


def _row(case: str, method: str, path: str | None, clients: int, figures: dict) -> Row:
    seconds = figures["p50"] if clients == 1 else 1 / figures["batches_per_s"]
    return Row(
        "torchrec",
        case=case,
        name=method,
        path=path,
        seconds=seconds,
        role="subject" if method == SUBJECT else "baseline",
        baseline=LOCAL if method != LOCAL else None,
        ok=figures["ok"],
        note=f"p50 {figures['p50'] * 1e3:.2f} ms, p99 {figures['p99'] * 1e3:.2f} ms, "
        f"{figures['batches_per_s']:.0f} batches/s",
        extra=dict(figures),
    )


@scenario(
    "torchrec",
    help="a DLRM-like EmbeddingBagCollection served by the cluster vs local and per feature",
)
def torchrec_serving(ctx: Context) -> list[Row]:
    from shardserve import connect
    from shardserve.torchrec import RemoteEmbeddingBagCollection

    size = sizes(ctx.quick)
    scale = size["scale"]
    rows: list[Row] = []
    with ExitStack() as stack:
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="shardserve-trec-")))
        cluster = ctx.start_cluster(stack, RANKS)
        torch.manual_seed(0)
        built = models(scale)
        state = {}
        with connect(cluster.address) as writer:
            for kind, module in built.items():
                module.to_empty(device="cpu")
                init_weights(module)
                RemoteEmbeddingBagCollection.from_module(writer, module, "bench")
                state[kind] = module.state_dict()
        torch.save(state, folder / "model.pt")
        del built, state
        clients = Clients(max(size["clients"]), cluster.address, str(folder / "model.pt"), scale)
        stack.callback(clients.close)
        for batch in size["batches"]:
            batches_file = str(folder / f"batches-{batch}.pt")
            torch.save(make_batches(scale, batch, size["count"], seed=batch), batches_file)
            for count in size["clients"]:
                local = clients.run(count, LOCAL, "auto", batches_file)
                for path, transport in PATHS.items():
                    case = f"batch {batch}, {path}, {count} process{'es' if count > 1 else ''}"
                    rows.append(_row(case, LOCAL, None, count, local))
                    for method in (SUBJECT, BY_FEATURE):
                        figures = clients.run(count, method, transport, batches_file)
                        rows.append(_row(case, method, path, count, figures))
    return rows
