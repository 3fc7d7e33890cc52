"""Benchmarks (not tests): each module prints a table and, with --json FILE, JSON."""
