"""The coverage check: a tensor's chunks tile its shape with no gap and no overlap, whichever
dimension they split (experts and tensor-parallel columns split the second or a later one)."""

import pytest
from torch import Size
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

from tasks.checkpoint.verify import _tiles_exactly


def chunk(offsets, sizes):
    return ChunkStorageMetadata(offsets=Size(offsets), sizes=Size(sizes))


def columns(n, width=4, rows=8):
    return [chunk([0, i * width], [rows, width]) for i in range(n)]


@pytest.mark.parametrize("n", [1, 2, 3000])
def test_chunks_splitting_the_second_dimension_tile_it(n):
    assert _tiles_exactly((8, 4 * n), columns(n)) is None


def test_an_overlap_along_the_second_dimension_is_found_among_thousands():
    chunks = columns(3000)
    chunks[1500] = chunk([0, 1500 * 4 - 2], [8, 4])  # reaches two columns into its left neighbour
    assert "overlap" in _tiles_exactly((8, 4 * 3000), chunks)


def test_a_gap_is_found():
    chunks = columns(10)
    del chunks[3]
    assert _tiles_exactly((8, 40), chunks) == "chunks cover 288 of 320 elements (a gap)"


def test_a_grid_with_a_moved_cell_overlaps():
    grid = [chunk([a * 2, b * 2], [2, 2]) for a in range(20) for b in range(30)]
    assert _tiles_exactly((40, 60), grid) is None
    grid[-1] = chunk([38, 57], [2, 2])
    assert "overlap" in _tiles_exactly((40, 60), grid)


def test_a_chunk_outside_the_shape_is_named():
    assert "lies outside the shape [8, 40]" in _tiles_exactly((8, 40), columns(10) + [chunk([0, 40], [8, 4])])
