"""Benchmarks behind `kvmesh bench <name>`: workloads, runners, side-by-side reports."""
