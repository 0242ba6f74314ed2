"""Throughput and memory benchmarks (run by hand, never as timed tests)."""
