"""Shared fixtures."""

from pathlib import Path

import pytest

from ssl_vit.data.synthetic import make_synthetic_shards


@pytest.fixture(scope="session")
def synthetic_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with 2 shards of 48 synthetic 32px images (10 classes) and index.json."""
    out = tmp_path_factory.mktemp("synthetic_shards")
    make_synthetic_shards(out, n=96, image_size=32, seed=0, shard_size=48)
    return out
