"""The benchmarks: each module is run from the repository root as `python -m bench.NAME` (bench/README.md)."""
