"""The library's error type, its version, and the contexts calls run on."""
import ctypes
import operator
import threading

from . import _capi


class AttnError(RuntimeError):
    """A libattn call failed; .status is the attn_status code."""

    def __init__(self, status, message):
        super().__init__(message)
        self.status = status


def version():
    return _capi.lib.attn_version_string().decode()


class _Ctx:
    def __init__(self):
        h = ctypes.c_void_p()
        st = _capi.lib.attn_ctx_create(ctypes.byref(h))
        if st != 0:
            raise AttnError(st, _capi.lib.attn_strerror(st).decode())
        self.h = h

    def check(self, st):
        if st != 0:
            msg = _capi.lib.attn_ctx_error(self.h).decode() or _capi.lib.attn_strerror(st).decode()
            raise AttnError(st, msg)

    def set_threads(self, threads):
        self.check(_capi.lib.attn_ctx_set_threads(self.h, 0 if threads is None else operator.index(threads)))

    PRECISIONS = {"default": 0, "fp32": 1, "bf16": 2, "f16": 3}  # attn.h's attn_precision

    def set_precision(self, precision):
        name = "default" if precision is None else precision
        if name not in self.PRECISIONS:
            raise ValueError(f"precision must be one of {sorted(self.PRECISIONS)}, got {precision!r}")
        self.check(_capi.lib.attn_ctx_set_precision(self.h, self.PRECISIONS[name]))

    def __repr__(self):
        if self.h is None:
            return "_Ctx(destroyed)"
        kernel = _capi.lib.attn_kernel_name(_capi.lib.attn_ctx_kernel(self.h)).decode()
        return f"_Ctx(threads={_capi.lib.attn_ctx_threads(self.h)}, kernel={kernel!r})"

    def __del__(self):
        h = getattr(self, "h", None)
        if h is not None and _capi is not None:
            _capi.lib.attn_ctx_destroy(h)
            self.h = None


# A context must not be used by two threads at once: one per Python thread.
_local = threading.local()


def _ctx():
    c = getattr(_local, "ctx", None)
    if c is None:
        c = _local.ctx = _Ctx()
    return c
