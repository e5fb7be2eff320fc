"""Load generator for omniduplex: concurrency, latency and capacity, with readable reports.

Run as ``python -m loadtest`` or ``omniduplex-loadtest``; see docs/loadtest.md. Nothing here is
imported by the server (``loadtest/bench_*.py`` are standalone micro-benchmarks).
"""
