"""Attention implementations, their registry, and the float64 reference."""

from attnscope.attention.registry import IMPLEMENTATIONS, Implementation, get, register
from attnscope.attention.reference import attention_reference, causal_mask

# Importing each module registers its entries, in the order the driver shows them.
from attnscope.attention import fused  # noqa: E402,F401  (ours, last in tables but defined first)

__all__ = ["IMPLEMENTATIONS", "Implementation", "attention_reference", "causal_mask", "get",
           "register"]
