"""plot_attention: attention weights as matplotlib heatmaps."""
import numpy as np

from ._tensors import _to_numpy


def plot_attention(weights, tokens=None, *, key_tokens=None, heads=None, cmap="viridis", ncols=None,
                   vmin=0.0, vmax=None, title=None):
    """A matplotlib Figure with one heatmap per head and a shared colour bar.

    weights: [H, Nq, Nk], [1, H, Nq, Nk] or [Nq, Nk] (NumPy or torch), e.g.
    MultiheadAttention(..., need_weights=True, average_attn_weights=False)'s.
    tokens label the query axis (and the key axis unless key_tokens is given).
    heads: the head indices to draw (default all). vmax None = the largest weight.
    """
    try:
        import matplotlib
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("attn.plot_attention needs matplotlib (pip install matplotlib)") from e
    w = np.asarray(_to_numpy(weights, "weights"), np.float32)
    if w.ndim == 4 and w.shape[0] == 1:
        w = w[0]
    if w.ndim == 2:
        w = w[None]
    if w.ndim != 3:
        raise ValueError(f"weights must be [H, Nq, Nk], [1, H, Nq, Nk] or [Nq, Nk], got shape {w.shape}")
    H, Nq, Nk = w.shape
    heads = list(range(H)) if heads is None else [int(h) for h in heads]
    for h in heads:
        if not 0 <= h < H:
            raise ValueError(f"head {h} out of range 0..{H - 1}")
    qt = None if tokens is None else [str(t) for t in tokens]
    kt = qt if key_tokens is None else [str(t) for t in key_tokens]
    if qt is not None and len(qt) != Nq:
        raise ValueError(f"{len(qt)} tokens for {Nq} queries")
    if kt is not None and len(kt) != Nk:
        raise ValueError(f"{len(kt)} key tokens for {Nk} keys")
    ncols = ncols or min(len(heads), 4)
    nrows = (len(heads) + ncols - 1) // ncols
    vmax = float(w.max()) if vmax is None else vmax
    fig = Figure(figsize=(3.2 * ncols + 1, 3.2 * nrows))
    axes = fig.subplots(nrows, ncols, squeeze=False)
    im = None
    for i, ax in enumerate(axes.flat):
        if i >= len(heads):
            ax.set_axis_off()
            continue
        h = heads[i]
        im = ax.imshow(w[h], cmap=matplotlib.colormaps[cmap] if hasattr(matplotlib, "colormaps") else cmap,
                       vmin=vmin, vmax=vmax, interpolation="nearest", aspect="auto")
        ax.set_title(f"head {h}")
        if kt is not None:
            ax.set_xticks(range(Nk), kt, rotation=90, fontsize=7)
        if qt is not None:
            ax.set_yticks(range(Nq), qt, fontsize=7)
    fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8)
    if title:
        fig.suptitle(title)
    return fig
