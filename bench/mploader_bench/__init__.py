"""The benchmark harness of mploader (``mploader bench``); not part of the library.

A separate top-level package under ``bench/`` (its own ``bench/pyproject.toml``):
``import mploader`` never imports it.  :mod:`mploader_bench.peers` holds the
transports, the one place to add one.
"""
