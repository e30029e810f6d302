"""``seqpar.nn.state_dict.boxes``: the blocks of the unsharded tensor that one rank's local tensor holds,
under tensor parallelism alone and with FSDP2's row chunks of each shard. Oracle: shards cut here
independently (torch.chunk of each block, as tensor parallelism splits them; torch.chunk of the shard's
rows, as FSDP2 does), then every rank's blocks placed back must rebuild the unsharded tensor, each
element exactly once."""
import pytest
import torch

from seqpar.nn.state_dict import ShardLayout, boxes, local_rows


def _tp_shards(full, dim, block_sizes, t):
    """Rank r's shard: its 1/t of every block along ``dim``, concatenated (fused QKV, SwiGLU's fc1)."""
    blocks = full.split(block_sizes, dim)
    return [torch.cat([block.chunk(t, dim)[r] for block in blocks], dim) for r in range(t)]


def _layouts(full_shape, dim, block_sizes, t):
    out = []
    for r in range(t):
        pieces, local, start = [], 0, 0
        for size in block_sizes:
            part = size // t
            pieces.append((local, start + r * part, part))
            local, start = local + part, start + size
        out.append(ShardLayout(full_shape, dim, tuple(pieces)))
    return out


def _rebuild(shards, layouts, fsdp):
    """Every (tensor-parallel rank, FSDP2 chunk)'s blocks placed into a new tensor; also a count per
    element of how many blocks covered it."""
    full_shape = layouts[0].full_shape if layouts[0] is not None else shards[0].shape
    rebuilt, covered = torch.zeros(full_shape), torch.zeros(full_shape)
    for shard, layout in zip(shards, layouts):
        first = 0
        for local in shard.chunk(fsdp, 0) if fsdp else [shard]:
            for (dim, start, length), offsets, sizes in boxes(layout, shard.shape, first, local.shape[0]):
                target = tuple(slice(o, o + n) for o, n in zip(offsets, sizes))
                rebuilt[target] += local.narrow(dim, start, length)
                covered[target] += 1
            first += local.shape[0]
    return rebuilt, covered


@pytest.mark.parametrize("fsdp", [None, 2, 3, 5])
@pytest.mark.parametrize("t", [1, 2, 4])
def test_column_blocks_rebuild_the_unsharded_tensor(t, fsdp):
    """Grouped-query QKV [Q 16 rows, K 8, V 8] x 3 columns: under FSDP2 a chunk's rows cut through
    blocks (t = 2, 3 chunks of 6 rows: chunk 1 holds rank 0's last 2 Q rows and its 4 K rows)."""
    full = torch.randn(32, 3)
    rebuilt, covered = _rebuild(_tp_shards(full, 0, (16, 8, 8), t), _layouts((32, 3), 0, (16, 8, 8), t), fsdp)
    assert torch.equal(rebuilt, full) and (covered == 1).all()


@pytest.mark.parametrize("fsdp", [None, 3])
def test_row_parallel_columns_rebuild_the_unsharded_tensor(fsdp):
    full = torch.randn(7, 8)                      # rows cut by FSDP2 (3, 3, 1), columns by t = 4
    rebuilt, covered = _rebuild(_tp_shards(full, 1, (8,), 4), _layouts((7, 8), 1, (8,), 4), fsdp)
    assert torch.equal(rebuilt, full) and (covered == 1).all()


@pytest.mark.parametrize("fsdp", [None, 3])
def test_replicated_tensor_rows_and_vocabulary_padding(fsdp):
    """A replicated tensor (no layout) is its chunks' rows; a vocabulary shard of 8 rows with 5 real
    ones gives no block for its padding (the chunk of rows 6-7 gives none at all)."""
    full = torch.randn(9, 2)
    rebuilt, covered = _rebuild([full], [None], fsdp)
    assert torch.equal(rebuilt, full) and (covered == 1).all()
    table = torch.randn(5, 2)
    shard = torch.cat([table, torch.full((3, 2), float("nan"))])
    rebuilt, covered = _rebuild([shard], [ShardLayout((5, 2), 0, ((0, 0, 5),))], fsdp)
    assert torch.equal(rebuilt, table) and (covered == 1).all()
    assert boxes(ShardLayout((5, 2), 0, ((0, 0, 5),)), (8, 2), 6, 2) == []


def test_plain_tensor_is_all_local():
    tensor = torch.randn(4, 3)
    local, chunks = local_rows(tensor)
    assert local is tensor and chunks.rows == ((0, 0, 4),) and chunks.index == 0 and chunks.group is None


def test_scatter_full_copies_the_real_rows_and_zeroes_the_padding():
    """A vocabulary shard of 8 rows, 5 real: scatter_full copies them and zeroes rows 5-7 (NaN before)."""
    from seqpar.nn.state_dict import scatter_full
    table, shard = torch.randn(5, 2), torch.full((8, 2), float("nan"))
    scatter_full(table, shard, ShardLayout((5, 2), 0, ((0, 0, 5),)))
    assert torch.equal(shard[:5], table) and torch.equal(shard[5:], torch.zeros(3, 2))
