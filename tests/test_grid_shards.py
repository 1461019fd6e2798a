from pathlib import Path

from benchmarks.grid_shards import parse_seeds, shard_dir


def test_a_shard_writes_to_its_named_folder_or_one_named_for_its_spec():
    root = Path("/r")
    assert shard_dir(root, "niah:4K,8K:0") == root / "niah-4K_8K-s0"
    assert shard_dir(root, "vt:8K:6-7") == root / "vt-8K-s6-7"
    # a split shard finishing a started seed goes where that seed's cells already are
    assert shard_dir(root, "vt:8K:5:vt-8K-s0-19") == root / "vt-8K-s0-19"


def test_seed_lists():
    assert parse_seeds("3") == [3]
    assert parse_seeds("6-9") == [6, 7, 8, 9]
    assert parse_seeds("0+2+5") == [0, 2, 5]
