"""Benchmarks: each prints figures and writes JSON under bench/results/."""
