#!/usr/bin/env python3
"""The package's face: attn exports its API and nothing else, reports the loaded
library's version, and its objects print their configuration. Needs NumPy only."""
import os
import re
import sys
import types

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import attn  # noqa: E402

API = {"AttnError", "scaled_dot_product_attention", "sdpa_backward", "MultiheadAttention", "KVCache",
       "plot_attention", "rope", "head_norm", "version", "library_path"}


def main():
    assert set(attn.__all__) == API, sorted(set(attn.__all__) ^ API)
    for name in attn.__all__:
        assert hasattr(attn, name), name
    # the helpers' modules stay private: no attn.np, attn.ctypes, attn.threading
    public = {n for n in dir(attn) if not n.startswith("_")}
    assert public == API, sorted(public - API)
    for name in ("np", "ctypes", "threading"):
        assert not hasattr(attn, name), name
    leaked = [n for n in dir(attn) if isinstance(getattr(attn, n), types.ModuleType) and not n.startswith("_")]
    assert not leaked, leaked
    ns = {}
    exec("from attn import *", ns)
    assert set(ns) - {"__builtins__"} == API, sorted(ns)

    assert attn.__version__ == attn.version() and re.fullmatch(r"\d+\.\d+\.\d+", attn.__version__), attn.__version__

    m = attn.MultiheadAttention(8, 2, num_kv_heads=1, batch_first=True)
    assert repr(m) == ("MultiheadAttention(embed_dim=8, num_heads=2, num_kv_heads=1, kdim=8, vdim=8, bias=True, "
                       "batch_first=True)"), repr(m)
    c = attn.KVCache(2, 16, 1, 4, dtype="float16")
    assert repr(c) == ("KVCache(batch=2, capacity=16, kv_heads=1, head_dim=4, v_head_dim=4, dtype='float16', "
                       "lengths=(0, 0))"), repr(c)
    c.close()
    assert repr(c).endswith(", closed)"), repr(c)
    ctx = attn._context._Ctx()
    ctx.set_threads(3)
    assert re.fullmatch(r"_Ctx\(threads=3, kernel='\w+'\)", repr(ctx)), repr(ctx)
    print("test_package: ok")


if __name__ == "__main__":
    main()
