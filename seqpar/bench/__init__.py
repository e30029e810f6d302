"""Benchmark harness of ``python -m seqpar bench`` (see :mod:`seqpar.bench.layer_bench`)."""
