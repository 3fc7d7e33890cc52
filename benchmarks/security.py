"""What security costs: lookups with the interceptor's role checks against none; a fetch over the TLS bulk port
against the plaintext bulk port, gRPC+TLS and plain gRPC.

Three 1-rank clusters, one after another: no client auth; a tokens file (the
lookups carry a read principal's token, so every call is authenticated and
checked against its rule); a tokens file with mutual TLS (the fetch over the
bulk port then runs TLS with the cluster's certificates). Lookups of 64 ids go
over gRPC (the path every call of which passes the interceptor), the clients
taking turns; fetches of the whole 64 MiB tensor (8 MiB with --quick) run over
transport "bulk" and "grpc", checked bit for bit against the source.

    python -m benchmarks --only security           (or: python -m benchmarks.security [--quick] [--json FILE])
"""

from __future__ import annotations

import argparse
import json
import shutil
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import torch

from benchmarks.harness import Context, Row, scenario
from benchmarks.latency import percentile

LOOKUP_ROWS, LOOKUP_COLUMNS, LOOKUP_IDS = 100_000, 64, 64
FETCH_COLUMNS = 1024
READ_TOKEN, ADMIN_TOKEN = "bench-read-token", "bench-admin-token"


def tokens_file(directory: Path) -> str:
    """A tokens file with a read principal and an admin principal."""
    from shardserve.server.common.principals import token_sha256

    path = directory / "tokens.toml"
    path.write_text(
        f'[[principal]]\nname = "inference"\ntoken_sha256 = "{token_sha256(READ_TOKEN)}"\nrole = "read"\n'
        f'[[principal]]\nname = "operator"\ntoken_sha256 = "{token_sha256(ADMIN_TOKEN)}"\n'
        f'role = "admin"\n'
    )
    return str(path)


def certificate(directory: Path):
    """A self-signed certificate for 127.0.0.1 (server certificate, client certificate and CA), or None
    without the openssl CLI."""
    from shardserve.server.common.auth import TlsFiles

    if shutil.which("openssl") is None:
        return None
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-keyout",
            str(directory / "key.pem"),
            "-out",
            str(directory / "cert.pem"),
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return TlsFiles(
        str(directory / "cert.pem"), str(directory / "key.pem"), str(directory / "cert.pem")
    )


def time_lookups(
    remotes: dict[str, object], ids: torch.Tensor, rounds: int
) -> dict[str, dict[str, float]]:
    """p50/p99 seconds of one lookup per remote table, the remotes taking turns each round (one warm-up round)."""
    spent: dict[str, list[float]] = {name: [] for name in remotes}
    for _ in range(rounds + 1):
        for name, remote in remotes.items():
            start = time.perf_counter()
            remote.lookup(ids)
            spent[name].append(time.perf_counter() - start)
    return {
        name: {"p50": statistics.median(times[1:]), "p99": percentile(times[1:], 0.99)}
        for name, times in spent.items()
    }


def time_fetch(remote, source: torch.Tensor, path: str, rounds: int) -> float:
    """Median seconds of fetching the whole tensor over `path`, checked bit for bit (one warm-up)."""
    spent = []
    for _ in range(rounds + 1):
        start = time.perf_counter()
        got = remote.full_tensor()
        spent.append(time.perf_counter() - start)
        if remote.last_transport != path or not torch.equal(got, source):
            raise RuntimeError(
                f"fetch over {path} ran over {remote.last_transport} or returned other bytes"
            )
    return statistics.median(spent[1:])


def measure(quick: bool, start_cluster) -> dict:
    """Every figure of the scenario: lookups p50/p99 by auth, fetch seconds by path. `start_cluster(stack,
    **kwargs)` starts a 1-rank cluster stopped when `stack` closes."""
    from shardserve import connect
    from shardserve.server.common.auth import Security
    from shardserve.server.common.principals import PrincipalBook

    rounds, fetch_rounds = (200, 3) if quick else (2000, 5)
    fetch_rows = (8 << 20 if quick else 64 << 20) // (4 * FETCH_COLUMNS)
    generator = torch.Generator().manual_seed(0)
    table = torch.randn(LOOKUP_ROWS, LOOKUP_COLUMNS, generator=generator)
    ids = torch.randint(0, LOOKUP_ROWS, (LOOKUP_IDS,), generator=generator)
    source = torch.randn(fetch_rows, FETCH_COLUMNS, generator=generator)
    out: dict = {
        "fetch_bytes": source.numel() * 4,
        "lookup_ids": LOOKUP_IDS,
        "openssl": ssl.OPENSSL_VERSION,
    }
    with ExitStack() as stack:
        files = Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="shardserve-bench-security-"))
        )
        tokens = tokens_file(files)
        tls = certificate(files)
        plain = start_cluster(stack)
        checked = start_cluster(stack, security=Security(principals=PrincipalBook(tokens)))
        none_client = stack.enter_context(connect(plain.address, transport="grpc"))
        checked_client = stack.enter_context(
            connect(checked.address, token=READ_TOKEN, transport="grpc")
        )
        with connect(plain.address) as writer:
            writer.put("table", table)
            writer.put("fetched", source)
        with connect(checked.address, token=ADMIN_TOKEN) as writer:
            writer.put("table", table)
        out["lookups"] = time_lookups(
            {
                "no client auth": none_client.tensor("table"),
                "role checks": checked_client.tensor("table"),
            },
            ids,
            rounds,
        )
        out["fetch"] = {}
        for path in ("bulk", "grpc"):
            with connect(plain.address, transport=path) as client:
                out["fetch"][f"plaintext {path}"] = time_fetch(
                    client.tensor("fetched"), source, path, fetch_rounds
                )
        if tls is not None:
            secure = start_cluster(
                stack, security=Security(tls=tls, principals=PrincipalBook(tokens))
            )
            credentials = dict(tls_ca=tls.ca, tls_cert=tls.cert, tls_key=tls.key)
            with connect(secure.address, token=ADMIN_TOKEN, **credentials) as writer:
                writer.put("fetched", source)
            for path in ("bulk", "grpc"):
                with connect(
                    secure.address, token=READ_TOKEN, transport=path, **credentials
                ) as client:
                    out["fetch"][f"TLS {path}"] = time_fetch(
                        client.tensor("fetched"), source, path, fetch_rounds
                    )
    return out


def rows_of(result: dict) -> list[Row]:
    """The benchmark rows: lookups (p50 and p99 cases, baseline no client auth) and fetches (baseline the
    plaintext bulk port)."""
    rows = []
    for stat in ("p50", "p99"):
        case = f"lookup of {result['lookup_ids']} ids over gRPC, {stat}"
        for name, figures in result["lookups"].items():
            rows.append(
                Row(
                    "security",
                    case,
                    name,
                    figures[stat],
                    path="grpc",
                    role="baseline" if name == "no client auth" else "subject",
                )
            )
    case = f"fetch of {result['fetch_bytes'] >> 20} MiB"
    labels = {
        "plaintext bulk": ("bulk port, plaintext", "bulk"),
        "TLS bulk": ("bulk port, TLS", "bulk"),
        "plaintext grpc": ("gRPC, plaintext", "grpc"),
        "TLS grpc": ("gRPC+TLS", "grpc"),
    }
    for key, seconds in result["fetch"].items():
        name, path = labels[key]
        rows.append(
            Row(
                "security",
                case,
                name,
                seconds,
                path=path,
                nbytes=result["fetch_bytes"],
                ok=True,
                role="baseline" if key == "plaintext bulk" else "subject",
                note=result["openssl"] if key.startswith("TLS") else "",
            )
        )
    return rows


@scenario(
    "security",
    help="lookups with role checks vs none; fetch over the TLS bulk port vs plaintext and gRPC+TLS",
)
def security_scenario(ctx: Context) -> list[Row]:
    """A scenario of the suite: measure(), as rows."""
    return rows_of(
        measure(ctx.quick, lambda stack, **options: ctx.start_cluster(stack, 1, **options))
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.security", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    from benchmarks.rss import RssSampler

    with RssSampler() as sampler:
        rows = security_scenario(Context(quick=args.quick, sampler=sampler))
    for row in rows:
        print(
            f"{row.case:40s} {row.name:22s} {row.seconds * 1e3:9.3f} ms"
            + (f"  {row.gb_per_s:.2f} GB/s" if row.gb_per_s else "")
        )
    if args.json:
        Path(args.json).write_text(json.dumps([row.to_json() for row in rows], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
