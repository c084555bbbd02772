"""``kvloom bench``: benchmarks (``serve`` against a running server, ``throughput`` offline)."""

from __future__ import annotations

from typing import Any


def register_subparser(subparsers: Any) -> None:
    from kvloom.entrypoints.cli import bench_serve, bench_throughput

    bench = subparsers.add_parser("bench", help="Benchmarks.", description=__doc__)
    benchmarks = bench.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    bench_serve.register(benchmarks)
    bench_throughput.register(benchmarks)
