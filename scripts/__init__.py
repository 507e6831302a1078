"""Benchmarks, load and crash drivers, and their shared helpers."""
