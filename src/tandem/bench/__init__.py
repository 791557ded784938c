"""Benchmarks: offline engine throughput, speculation sweeps, tool workloads, and an HTTP load generator."""
