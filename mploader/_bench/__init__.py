"""Benchmarks of mploader against other batch transports (not part of the public API)."""
