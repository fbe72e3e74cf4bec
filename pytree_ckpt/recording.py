"""Whether a tracer records the forward as a program: torch.jit.trace, torch.export,
torch.fx.symbolic_trace.

NOTE [a tracer records the plain forward]: the program a tracer records is the forward's ops,
to run or train later without this library: a boundary, an output discard and an offload window
are plain calls while one records (boundary.py, discard.py, offload's eager_window), as they
are under no-grad. torch.fx's tracing flag is set by make_fx too, which AOT autograd and
compiled autograd trace with: there a boundary is built as ever (a replay's nested boundaries
stay boundaries), so the flag counts only with no make_fx proxy mode active.
symbolic_trace calls a layer with proxies, or with real tensors where it reads a buffer (helper
LI: a call's leaves alone do not tell the two apart); make_fx has its proxy mode on, but for
make_fx(pre_dispatch=True), whose mode sits on another stack (helper LM): a non-strict export's
tracer, told by the export flag anyway, and one a user runs by hand records the plain forward.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["proxy_tracing", "symbolic_tracing", "tracer_records"]

_is_tracing: Any = torch._C._is_tracing  # torch.jit.trace records (torch.jit.is_tracing's test)
_compiler = torch.compiler  # _is_exporting_flag: torch.compiler.is_exporting()'s, read as is
_fx_trace: Any = torch.fx._symbolic_trace  # _is_fx_tracing_flag: is_fx_tracing()'s, unwarned
_get_mode: Any = torch._C._get_dispatch_mode
_PROXY: Any = torch._C._TorchDispatchModeKey.PROXY


def symbolic_tracing() -> bool:
    """torch.fx.symbolic_trace (or another fx ``Tracer``) records, not make_fx."""
    return getattr(_fx_trace, "_is_fx_tracing_flag", False) and _get_mode(_PROXY) is None


def proxy_tracing() -> bool:
    """NOTE [make_fx records storages nowhere]: make_fx (proxy tensors) traces a training step
    through the boundary, its autograd Function and its replay alike, op by op; but it cannot
    record an op taking a storage (fx's "argument of type: UntypedStorage"): offload's copy to
    host (``empty(0).set_(storage)``) and an output discard's rebuild into its freed storage
    raised at the first save or backward (helper QK). Under it offload windows copy nothing and
    output discard is a plain call: the program holds eager's ops, and its memory plan is the
    compiler's."""
    return _get_mode(_PROXY) is not None


def tracer_records() -> bool:
    """NOTE [a tracer records the plain forward]: torch.jit.trace, torch.export (strict or
    not) or torch.fx.symbolic_trace records the forward now."""
    return bool(_is_tracing()) or getattr(_compiler, "_is_exporting_flag", False) \
        or symbolic_tracing()
