"""Context parallelism: attention over a sequence sharded across the ranks of a torch.distributed
group (ring attention), and the helpers that shard a full sequence and gather it back."""

from attnscope.parallel.ring import ring_attention
from attnscope.parallel.sharding import chunk_order, shard_sequence, unshard_sequence

__all__ = ["chunk_order", "ring_attention", "shard_sequence", "unshard_sequence"]
