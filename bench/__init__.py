"""Benchmarks: each compares flowtrain against a named anchor in the same run and prints ratios."""
