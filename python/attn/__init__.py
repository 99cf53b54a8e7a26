"""libattn for Python: exact attention on NumPy arrays and PyTorch CPU tensors.

The shared library is called through ctypes; inputs are passed as strided
views (no copy) whenever they are float32 with non-negative strides, and so
are the float16/bfloat16 q, k, v of the forward pass and of the KV cache.
"""
from ._cache import KVCache, PagedKVCache
from ._capi import library_path
from ._context import AttnError, version
from ._layer import MultiheadAttention
from ._plot import plot_attention
from ._rope import head_norm, rope
from ._sdpa import scaled_dot_product_attention, sdpa_backward

__all__ = ["AttnError", "scaled_dot_product_attention", "sdpa_backward", "MultiheadAttention", "KVCache",
           "PagedKVCache",
           "plot_attention", "rope", "head_norm", "version", "library_path"]

__version__ = version()  # the loaded library's, so a stale build shows
