"""Benchmarks: scripts that print a table and write JSON (and a plot), reproducible by a user."""
