"""Hand-built shard tables for the widget tests (also pasted into test notebooks as source)."""

from __future__ import annotations

TABLE_CODE = '''
from fsdp_nb.shard_table import ParamShard, ShardTable

def _param(name, shape, sizes, mesh=(3,), dims=("dp_shard",), placements=("Shard(0)",)):
    rest = 1
    for d in shape[1:]:
        rest *= d
    offsets, o = [], 0
    for s in sizes:
        offsets.append((o,) + (0,) * (len(shape) - 1))
        o += s
    return ParamShard(name, tuple(shape), "float32", placements, mesh, dims,
                      tuple((s,) + tuple(shape[1:]) for s in sizes), tuple(offsets),
                      tuple(s * rest * 4 for s in sizes))

def hand_table():
    """3 ranks, uneven shards (10 rows over 3 ranks), one rank holding nothing of one."""
    return ShardTable("model", 3, (3,), ("dp_shard",), (
        _param("blocks.0.lin.weight", (10, 4), (4, 4, 2)),
        _param("blocks.0.lin.bias", (10,), (4, 4, 2)),
        _param("head.weight", (2, 10), (1, 1, 0)),
    ))

def hybrid_table():
    """4 ranks on a 2x2 (dp_replicate, dp_shard) mesh: replicated across rows."""
    mesh, dims, pl = (2, 2), ("dp_replicate", "dp_shard"), ("Replicate()", "Shard(0)")
    p = ParamShard("w", (8, 2), "float32", pl, mesh, dims, ((4, 2),) * 4,
                   ((0, 0), (4, 0), (0, 0), (4, 0)), (32,) * 4)
    return ShardTable("hybrid", 4, mesh, dims, (p,))
'''

_ns: dict = {}
exec(TABLE_CODE, _ns)
hand_table = _ns["hand_table"]
hybrid_table = _ns["hybrid_table"]
