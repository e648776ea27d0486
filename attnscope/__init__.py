"""attnscope: a fused causal-attention kernel in Triton, and a driver that profiles it against
PyTorch's attention implementations."""

from attnscope._version import __version__
from attnscope.attention import IMPLEMENTATIONS
from attnscope.attention.fused import fused_attention

__all__ = ["IMPLEMENTATIONS", "__version__", "fused_attention"]
