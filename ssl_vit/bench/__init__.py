"""Benchmark machinery of scripts/bench.py (timm is needed only here)."""
