"""Workloads shared by benchmarks and the simulator: prompt sets, datasets, arrivals, tool-call traces."""
