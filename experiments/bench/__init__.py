"""Benchmarks: `python -m experiments.bench.<name>`; each takes --smoke (the smallest run: that
the command works, no figures) and times peers with experiments.bench.timing."""
