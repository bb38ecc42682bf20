"""Where a rank's piece of a checkpointed tensor lies in the whole tensor (``flowtrain.train.checkpoint``'s sharded
state): a ``Piece`` (a flat range of a tensor shard's slice of a parameter, the range a ZeRO replica owns), cut into
boxes of the saved tensor's shape (DCP chunks with their offsets), whatever shape the ranks that wrote it saved it in.
Pure index arithmetic, no I/O.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

__all__ = ["Piece", "as_piece", "boxes", "placements", "runs"]


@dataclass(frozen=True)
class Piece:
    """A rank's piece of a saved tensor of shape ``whole``: elements ``[start, start + its numel)``, in row-major
    order, of the block at ``corner`` with shape ``block`` (a tensor shard's slice of a parameter, whose flat range
    a ZeRO replica owns). It is saved in the whole shape, as the boxes ``boxes`` cuts it into (DCP chunks with
    their offsets: two or three for a 2-D slice), so a shard's slices keep the parameter's own name."""

    start: int
    whole: tuple[int, ...]
    corner: tuple[int, ...]
    block: tuple[int, ...]


def as_piece(spec) -> Piece:
    """A ``chunks`` value as a ``Piece``: ``(offset, whole length)`` is a flat range of a flat tensor."""
    if isinstance(spec, Piece):
        return spec
    offset, length = spec
    return Piece(int(offset), (int(length),), (0,), (int(length),))


def boxes(start: int, numel: int, shape: tuple[int, ...]) -> list[tuple[tuple, tuple, int]]:
    """Elements ``[start, start + numel)`` of a row-major tensor of ``shape`` as boxes ``(offsets, sizes, at)``, each
    contiguous in that order (a partial row, whole rows, a partial row, recursively), ``at``: its first element's
    place in the range."""
    if not shape:
        return [((), (), 0)] if numel else []
    out: list[tuple[tuple, tuple, int]] = []

    def walk(lo: int, hi: int, depth: int, prefix: tuple, at: int) -> None:
        if lo >= hi:
            return
        dims, ones = shape[depth:], (1,) * depth
        inner = math.prod(dims[1:])
        if len(dims) == 1 or (lo % inner == 0 and hi % inner == 0):
            rest = (0,) * (len(dims) - 1)
            out.append((prefix + (lo // inner,) + rest, ones + ((hi - lo) // inner,) + dims[1:], at))
            return
        first, last = lo // inner, (hi - 1) // inner
        if first == last:
            walk(lo - first * inner, hi - first * inner, depth + 1, prefix + (first,), at)
            return
        head, tail = (first + 1) * inner, last * inner
        walk(lo, head, depth, prefix, at)
        walk(head, tail, depth, prefix, at + head - lo)
        walk(tail, hi, depth, prefix, at + tail - lo)

    walk(start, start + numel, 0, (), 0)
    return out


def runs(offsets: tuple, sizes: tuple, whole: tuple) -> list[tuple[int, int, int]]:
    """A box of a row-major tensor of shape ``whole`` as flat runs ``(offset, length, at)``, ``at``: the run's place
    in the box (in its row-major order)."""
    if not whole:
        return [(0, 1, 0)]
    lead = len(whole) - 1
    while lead > 0 and sizes[lead] == whole[lead]:
        lead -= 1
    strides = [math.prod(whole[i + 1:]) for i in range(len(whole))]
    length = math.prod(sizes[lead:])
    base = sum(o * st for o, st in zip(offsets[lead:], strides[lead:]))
    out = []
    for k, index in enumerate(itertools.product(*(range(n) for n in sizes[:lead]))):
        out.append((base + sum((offsets[i] + j) * strides[i] for i, j in enumerate(index)), length, k * length))
    return out


def placements(spec, numel: int, saved: tuple[int, ...]) -> list[tuple[tuple, tuple, int]]:
    """Where the ``numel`` elements of a rank's piece (a ``chunks`` value) lie in a saved tensor of shape ``saved``
    (the same number of elements, in whichever shape it was saved): boxes ``(offsets, sizes, at)`` of it, each
    contiguous in the piece, ``at`` its place there."""
    p, saved = as_piece(spec), tuple(saved)
    if p.block == p.whole:  # a flat range of the whole tensor: the same range of the saved one, in its shape
        return boxes(p.start, numel, saved)
    cut = [(tuple(c + o for c, o in zip(p.corner, off)), size, at) for off, size, at in boxes(p.start, numel, p.block)]
    if saved == tuple(p.whole):
        return cut
    return [(o, s, at + run_at + sub_at) for off, size, at in cut for flat, length, run_at in runs(off, size, p.whole)
            for o, s, sub_at in boxes(flat, length, saved)]
