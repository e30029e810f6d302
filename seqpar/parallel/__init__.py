"""Process-group helpers and the conjugate communication operators of tensor / sequence parallelism.

Megatron's vocabulary: ``copy_to_tensor_region`` is the paper's f, ``reduce_from_tensor_region`` is
f-bar, ``gather_from_sequence_region`` is g and ``reduce_scatter_to_sequence_region`` is g-bar;
``scatter_to_sequence_region`` enters the sequence-parallel region and ``gather_to_replicated_region``
leaves it for a tail every rank computes alike.
"""
from .mappings import (
    copy_to_tensor_region,
    copy_to_tensor_region_coalesced,
    gather_from_sequence_region,
    gather_to_replicated_region,
    reduce_from_tensor_region,
    reduce_scatter_to_sequence_region,
    scatter_to_sequence_region,
)
from .overlap import ChunkPlan, record_schedule
from .state import group_rank, group_size, sequence_shard

__all__ = [
    "copy_to_tensor_region", "copy_to_tensor_region_coalesced", "reduce_from_tensor_region",
    "gather_from_sequence_region", "reduce_scatter_to_sequence_region", "scatter_to_sequence_region",
    "gather_to_replicated_region",
    "group_rank", "group_size", "sequence_shard", "ChunkPlan", "record_schedule",
]
