"""Attention implementations, their registry, and the float64 reference."""

from attnscope.attention.registry import IMPLEMENTATIONS, Implementation, get, register
from attnscope.attention.reference import attention_reference, causal_mask

# Importing each module registers its entries, in the order the driver shows them: the blog's
# scripts in order, then ours last.
from attnscope.attention import naive  # noqa: E402,F401
from attnscope.attention import sdpa  # noqa: E402,F401
from attnscope.attention import flex  # noqa: E402,F401
from attnscope.attention import hub  # noqa: E402,F401
from attnscope.attention import flash_attn  # noqa: E402,F401
from attnscope.attention import ours  # noqa: E402,F401  (the fused op's entries)

__all__ = ["IMPLEMENTATIONS", "Implementation", "attention_reference", "causal_mask", "get",
           "register"]
