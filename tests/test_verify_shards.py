"""The pieces of the Slurm verify engine that need no cluster: segmented hashes, the shard plan,
and the checks on a shard's result file. (On the real local cluster: test_verify_slurm.py.)"""

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import xxhash

from tasks.checkpoint.dcp import build_index, load_dcp_metadata
from tasks.checkpoint.manifest import read_manifest
from tasks.checkpoint.scan import FileScan, owned_records, scan_file
from tasks.checkpoint.shards import (
    Piece,
    PieceResult,
    Shard,
    ShardPlan,
    ShardResult,
    merge,
    plan_shards,
    read_result,
    result_path,
)
from tasks.checkpoint.slurm_engine import time_limit_seconds
from tasks.checkpoint.state import State
from tasks.errors import Malformed
from tasks.storage.digest import FileHash, Hashing, combine, comparable
from tests.conftest import flip_byte, iter_dir, verify_and_record_here

MB = 1 << 20


def test_a_file_within_one_segment_keeps_its_plain_xxh3_hash():
    data = os.urandom(3000)
    hasher = FileHash(Hashing(segment_bytes=4096))
    hasher.update(data)
    assert combine(hasher.finish()) == xxhash.xxh3_128(data).hexdigest()
    empty = FileHash(Hashing(segment_bytes=4096))
    assert combine(empty.finish()) == xxhash.xxh3_128(b"").hexdigest()


def test_a_longer_file_hashes_its_segment_digests_however_it_is_fed():
    data = os.urandom(10_000)
    whole = FileHash(Hashing(segment_bytes=4096))
    whole.update(data)
    expected = xxhash.xxh3_128(
        b"".join(xxhash.xxh3_128(data[i : i + 4096]).digest() for i in range(0, len(data), 4096))
    ).hexdigest()
    assert combine(whole.finish()) == expected
    # Two readers, each starting on a segment boundary, in odd-sized writes.
    first, second = FileHash(Hashing(segment_bytes=4096), 0), FileHash(Hashing(segment_bytes=4096), 8192)
    for i in range(0, 8192, 1000):
        first.update(data[i : min(i + 1000, 8192)])
    second.update(data[8192:])
    assert combine(first.finish() + second.finish()) == expected
    with pytest.raises(ValueError, match="not on a 4096-byte segment boundary"):
        FileHash(Hashing(segment_bytes=4096), 100)


# Published values, from implementations other than the ones we call: BLAKE3's official test
# vectors (github.com/BLAKE3-team/BLAKE3, test_vectors.json: input byte i is i % 251) and FIPS
# 180-2's SHA-256 of "abc".
BLAKE3_EMPTY = "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"
BLAKE3_1024 = "42214739f095a406f3fc83deb889744ac00df831c10daa55189b5d121c855af7"
SHA256_ABC = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


def test_cryptographic_digests_within_one_segment_are_the_standard_ones():
    blake = Hashing("blake3", 4096)
    assert combine(FileHash(blake).finish(), "blake3") == BLAKE3_EMPTY
    vector = FileHash(blake)
    vector.update(bytes(i % 251 for i in range(1024)))
    assert combine(vector.finish(), "blake3") == BLAKE3_1024
    sha = FileHash(Hashing("sha256", 4096))
    sha.update(b"abc")
    assert combine(sha.finish(), "sha256") == SHA256_ABC
    with pytest.raises(ValueError, match="unknown hash algorithm 'md5'"):
        Hashing("md5")


@pytest.mark.parametrize("algorithm", ["blake3", "sha256"])
def test_spans_of_a_file_read_apart_agree_with_one_reader_for_every_digest(tmp_path, algorithm):
    path = tmp_path / "a.distcp"
    path.write_bytes(os.urandom(3 * MB + 5))
    hashing = Hashing(algorithm, MB)
    whole = scan_file(path, [], hashing=hashing)
    spans = [
        scan_file(path, [], hashing=hashing, span=(a, b)) for a, b in [(0, 2 * MB), (2 * MB, 3 * MB + 5)]
    ]
    assert combine([d for s in spans for d in s.segments], algorithm) == whole.hash
    assert all(len(d) == hashing.digest_bytes == 32 for s in spans for d in s.segments)
    assert whole.hash != scan_file(path, [], hashing=Hashing("xxh3-128", MB)).hash


def test_hashes_are_comparable_only_where_segments_cannot_differ():
    assert comparable(MB, MB, [10 * MB])
    assert comparable(None, MB, [MB, 10])  # an old whole-file manifest of small files
    assert not comparable(None, MB, [MB + 1])
    assert not comparable(4 * MB, MB, [2 * MB])


def test_spans_of_a_real_data_file_give_the_whole_files_hash_crcs_and_failures(medium_save_dir):
    directory = iter_dir(medium_save_dir, 4)
    records = build_index(load_dcp_metadata(directory / ".metadata")).files["__0_0.distcp"]
    path = directory / "__0_0.distcp"
    size = path.stat().st_size
    whole = scan_file(path, records, hashing=Hashing(segment_bytes=MB))
    assert whole.failures == [] and whole.records == len(records) and size > 4 * MB
    cuts = [0, 2 * MB, 3 * MB, size]
    spans = [
        scan_file(
            path, owned_records(records, a, b, b == size), hashing=Hashing(segment_bytes=MB), span=(a, b)
        )
        for a, b in zip(cuts, cuts[1:])
    ]
    assert combine([d for s in spans for d in s.segments]) == whole.hash
    assert sum(s.records for s in spans) == len(records)  # each record checked once
    assert not any(s.changed for s in spans)


def test_shards_balance_bytes_split_large_files_and_keep_writer_order():
    sizes = {"__10_0.distcp": 10 * MB, "__2_0.distcp": 10 * MB, "metadata.json": 100, ".metadata": 4000}
    shards = plan_shards(sizes, 4, MB)
    assert len(shards) == 4
    loads = [s.bytes for s in shards]
    assert max(loads) - min(loads) <= MB  # within one segment
    assert sum(loads) == sum(sizes.values())
    order = [p.name for s in shards for p in s.pieces]
    assert order.index("__2_0.distcp") < order.index("__10_0.distcp")  # by rank, not by string
    # Every byte of every file planned exactly once.
    for name, size in sizes.items():
        spans = sorted((p.start, p.end) for s in shards for p in s.pieces if p.name == name)
        assert spans[0][0] == 0 and spans[-1][1] == size
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert all(len(s.pieces) == len(s.files) for s in shards)  # a shard holds one span per file
    assert plan_shards(sizes, 1, MB)[0].bytes == sum(sizes.values())


def test_a_file_whose_sha256_is_wanted_stays_whole_and_tiny_checkpoints_use_fewer_shards():
    shards = plan_shards({"a.distcp": 10 * MB, "b.distcp": 10}, 8, MB, whole={"a.distcp"})
    assert [p for s in shards for p in s.pieces if p.name == "a.distcp"] == [
        Piece("a.distcp", 0, 10 * MB, 10 * MB, True)
    ]
    assert len(shards) == 2  # two units, never an empty shard


def test_tasks_read_the_shard_of_the_node_before_theirs():
    plan = ShardPlan("/x", MB, 2, [Shard(i, []) for i in range(6)])
    assert [plan.shard_for_task(t) for t in range(6)] == [4, 5, 0, 1, 2, 3]


def _result(tmp_path, shard: Shard, changes: dict | None = None) -> Path:
    scans = [
        FileScan(p.name, size=p.size, start=p.start, end=p.end, segments=[b"\x01" * 16]) for p in shard.pieces
    ]
    result = ShardResult(shard.index, 0, "n1", 1.0, 10, [PieceResult.of(s) for s in scans])
    result.write(tmp_path)
    path = result_path(tmp_path, shard.index, 0)
    data = json.loads(path.read_text())
    data.update(changes or {})
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(
    "damage, message",
    [
        (None, "no result written"),
        ("{", "malformed result"),
        ({"pieces": []}, "differ from the plan's"),
        ({"shard": 3}, "result of shard 3, not 0"),
        ({"bytes": "many"}, "malformed result \\(bytes: Input should be a valid integer"),
        ({"surprise": 1}, "malformed result"),
    ],
)
def test_a_missing_or_malformed_result_fails_its_shard(tmp_path, damage, message):
    shard = Shard(0, [Piece("a.distcp", 0, 100, 100)])
    if damage is None:
        path = result_path(tmp_path, 0, 0)
    elif isinstance(damage, str):
        path = _result(tmp_path, shard)
        path.write_text(damage)
    else:
        path = _result(tmp_path, shard, damage)
    with pytest.raises(Malformed, match=message):
        read_result(path, shard, Hashing(segment_bytes=MB))


def test_a_result_with_the_wrong_number_of_segment_digests_is_refused(tmp_path):
    shard = Shard(0, [Piece("a.distcp", 0, 3 * MB, 3 * MB)])
    path = _result(tmp_path, shard)
    with pytest.raises(Malformed, match="1 segment digests, 3 expected"):
        read_result(path, shard, Hashing(segment_bytes=MB))


def test_merge_joins_spans_in_order_and_a_resized_file_counts_as_changed(tmp_path):
    shards = [Shard(0, [Piece("a", MB, 2 * MB, 2 * MB)]), Shard(1, [Piece("a", 0, MB, 2 * MB)])]
    planned = {"a": [7, 2 * MB, 1000]}
    results = {
        0: ShardResult(
            0,
            0,
            "n1",
            1,
            MB,
            [PieceResult("a", MB, 2 * MB, 2 * MB, ["22" * 16], records=2, stat=[7, 2 * MB, 1000])],
        ),
        1: ShardResult(
            1,
            0,
            "n2",
            1,
            MB,
            [PieceResult("a", 0, MB, 2 * MB, ["11" * 16], records=3, stat=[7, 2 * MB, 1000])],
        ),
    }
    scan = merge(shards, results, planned)["a"]
    assert scan.hash == combine([b"\x11" * 16, b"\x22" * 16]) and scan.records == 5 and not scan.changed
    # One span read from a file replaced since planning (same size, another version): never judged.
    results[0].pieces[0].stat = [8, 2 * MB, 2000]
    assert merge(shards, results, planned)["a"].changed
    results[0].pieces[0].stat, results[0].pieces[0].size = [7, 2 * MB, 1000], 3 * MB
    assert merge(shards, results, planned)["a"].changed


def test_a_span_of_a_file_gone_since_planning_reports_its_span_as_changed(tmp_path):
    shard = Shard(0, [Piece("gone.distcp", 0, 2 * MB, 3 * MB)])
    scan = scan_file(tmp_path / "gone.distcp", [], hashing=Hashing(segment_bytes=MB), span=(0, 2 * MB))
    assert scan.changed and (scan.start, scan.end) == (0, 2 * MB)
    ShardResult(0, 0, "n1", 0.1, 0, [PieceResult.of(scan)]).write(tmp_path)
    result = read_result(
        result_path(tmp_path, 0, 0), shard, Hashing(segment_bytes=MB)
    )  # accepted: it says changed
    assert merge([shard], {0: result}, {"gone.distcp": None})["gone.distcp"].changed


def test_a_result_that_skipped_records_or_a_needed_sha256_is_refused(tmp_path):
    shard = Shard(0, [Piece("a.distcp", 0, 100, 100, sha256=True, records=4)])
    path = _result(tmp_path, shard)
    data = json.loads(path.read_text())
    data["pieces"][0]["records"] = 0
    path.write_text(json.dumps(data))
    with pytest.raises(Malformed, match="0 records checked, 4 planned"):
        read_result(path, shard, Hashing(segment_bytes=MB))
    data["pieces"][0]["records"] = 4
    path.write_text(json.dumps(data))
    with pytest.raises(Malformed, match="no SHA-256, which integrity.json needs"):
        read_result(path, shard, Hashing(segment_bytes=MB))


def test_slurm_time_limits_parse_as_slurm_reads_them():
    assert time_limit_seconds("30") == 30 * 60
    assert time_limit_seconds("05:30") == 5 * 60 + 30
    assert time_limit_seconds("01:02:03") == 3723
    assert time_limit_seconds("2-00") == 2 * 86400
    assert time_limit_seconds("1-02:30") == 86400 + 2 * 3600 + 30 * 60


def test_an_old_manifest_of_whole_file_hashes_stays_the_reference(medium_save_dir, options):
    directory = iter_dir(medium_save_dir, 4)
    first = verify_and_record_here(
        directory, replace(options, hashing=Hashing(segment_bytes=None))
    )  # as before segments
    assert first.ok and first.manifest.hash_segment_bytes is None
    # Files of 20 MB in 1 MB segments: the reference's whole-file hashes are taken its way.
    again = verify_and_record_here(directory, replace(options, hashing=Hashing(segment_bytes=MB)))
    assert again.ok and again.manifest.verified_at == first.manifest.verified_at
    assert read_manifest(directory).files == first.manifest.files
    flip_byte(directory / "__0_0.distcp", 100)
    assert (
        verify_and_record_here(directory, replace(options, hashing=Hashing(segment_bytes=MB))).state
        is State.INVALID
    )
