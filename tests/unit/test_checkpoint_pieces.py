"""Where a rank's piece of a sharded checkpoint lies in the saved tensor (``flowtrain.train.checkpoint``): a ZeRO
range of a tensor shard's slice, placed as boxes (DCP chunks) of the whole parameter saved in its own shape or
flat, and a flat range read from a tensor saved in its own shape. Every element lands where it belongs, in few
boxes; in one process, DCP itself writes and reads a tensor saved that way."""
from __future__ import annotations

import math

import pytest
import torch

from flowtrain.train import checkpoint
from flowtrain.train.pieces import Piece, placements


def _gather(whole: torch.Tensor, piece, numel: int, saved: tuple) -> torch.Tensor:
    """The piece's elements read out of ``whole`` saved in shape ``saved``, through its placements."""
    out = torch.full((numel,), float("nan"))
    source = whole.reshape(saved)
    for offsets, sizes, at in placements(piece, numel, saved):
        box = source[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
        out[at:at + math.prod(sizes)] = box.reshape(-1)
    return out


@pytest.mark.parametrize(("whole", "dim", "lo", "hi"), [((7, 5), 0, 2, 5), ((7, 5), 1, 1, 4), ((6,), 0, 3, 6),
                                                       ((4, 3, 5), 2, 1, 3), ((4, 3, 5), 0, 0, 4)])
def test_a_range_of_a_slice_lands_on_its_elements_in_the_whole_or_flat(whole, dim, lo, hi):
    full = torch.arange(math.prod(whole), dtype=torch.float32).reshape(whole)
    block = tuple(hi - lo if i == dim else n for i, n in enumerate(whole))
    corner = tuple(lo if i == dim else 0 for i in range(len(whole)))
    flat_slice = full.narrow(dim, lo, hi - lo).reshape(-1)
    for start in range(len(flat_slice)):
        for stop in range(start + 1, len(flat_slice) + 1):
            piece = Piece(start, whole, corner, block)
            for saved in (whole, (math.prod(whole),)):
                got = _gather(full, piece, stop - start, saved)
                assert torch.equal(got, flat_slice[start:stop]), (start, stop, saved)
            if len(whole) == 2:  # a 2-D slice saved in its shape: a partial row, whole rows, a partial row
                assert len(placements(piece, stop - start, whole)) <= 3


def test_a_flat_range_reads_from_a_tensor_saved_in_its_shape():
    full = torch.arange(35, dtype=torch.float32).reshape(7, 5)
    for start, stop in ((0, 35), (3, 4), (3, 17), (10, 20), (12, 35)):
        assert torch.equal(_gather(full, (start, 35), stop - start, (7, 5)), full.reshape(-1)[start:stop])


def test_pieces_of_one_tensor_written_and_read_back_with_dcp(tmp_path):
    """DCP in one process writes a tensor shard's column slice (of a 6 x 4 parameter) as a piece of the whole
    parameter, in its shape, and reads ranges of the slice back from it."""
    full = torch.randn(6, 4)
    halves = full[:, :2].reshape(-1), full[:, 2:].reshape(-1)
    tensors = {"a": halves[0].clone(), "b": halves[1].clone()}
    chunks = {"a": Piece(0, (6, 4), (0, 0), (6, 2)), "b": Piece(0, (6, 4), (0, 2), (6, 2))}
    tmp = checkpoint.save_shards(tmp_path, 1, tensors, chunks)
    assert checkpoint.shard_names(tmp) == {"a": (6, 4), "b": (6, 4)}
    # each name holds one column half of its whole tensor (one process may leave the rest unwritten)
    back = {"a": torch.zeros(5), "b": torch.zeros(7)}
    checkpoint.load_shards(tmp, back, {"a": Piece(3, (6, 4), (0, 0), (6, 2)), "b": Piece(5, (6, 4), (0, 2), (6, 2))})
    assert torch.equal(back["a"], halves[0][3:8]) and torch.equal(back["b"], halves[1][5:12])
