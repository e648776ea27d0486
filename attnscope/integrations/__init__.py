"""Adapters that let other libraries run attnscope's fused attention.

Each adapter is its own module and imports its library only when imported itself, so the library
stays an optional extra: `import attnscope.integrations.transformers` registers the transformers
attention backend (install with `pip install attnscope[transformers]`).
"""
