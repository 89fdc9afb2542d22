"""Dataset generators: synthetic shapes (smoke tests) and ImageNet-like photos (benchmarks)."""

from ssl_vit.datasets.synthetic import SYNTHETIC_LABELS, make_synthetic_shards, synthetic_shapes

__all__ = ["SYNTHETIC_LABELS", "make_synthetic_shards", "synthetic_shapes"]
