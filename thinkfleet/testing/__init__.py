"""Helpers for tests, benchmarks and demos (no test framework imports here)."""
