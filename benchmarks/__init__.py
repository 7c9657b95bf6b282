"""The benchmarks: runnable scripts (`python -m benchmarks.<name>` from the repository root) and the helpers they share."""
