"""Throughput, checkpoint and memory benchmarks: ratios against baselines measured in the same run
(see docs/benchmarks.md)."""
