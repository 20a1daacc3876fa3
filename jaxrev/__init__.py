"""jaxrev: transformations JAX does not have: run programs backwards, and more.

>>> import jaxrev as jr
"""

import contextlib as _contextlib
import importlib as _importlib
import sys as _sys

from jaxrev._compat import on_trace as _on_trace
from jaxrev._errors import (
    DriftError,
    DtypeError,
    FailureWarning,
    PerformanceWarning,
    JaxrevError,
    NotConvergedError,
    NotInvertibleError,
    ReversibilityError,
    SingularJacobianError,
)
from jaxrev._runtime import jit, raise_runtime_errors
from jaxrev import optim
from jaxrev.primitives import apply_gate, rot, swap
from jaxrev.transforms.control_flow import cond, while_loop
from jaxrev.transforms.sweep.drift import DriftWarning, LoopRepair, RepairReport
from jaxrev.transforms.sweep.exact import Exact
from jaxrev.transforms.custom_rules import (
    custom_inverse,
    forward_mode,
    hook,
    nestlevel,
    recompute,
    store,
)
from jaxrev.transforms.flows.bijector import Bijector, Chain
from jaxrev.transforms.flows.slogdet import (
    forward_and_slogdet,
    inverse_and_slogdet,
    logdet_strategy,
    register_logdet,
    slogdet_jacobian,
)
from jaxrev.transforms.inverse_ad import inverse_jvp, inverse_vjp
from jaxrev.transforms.registry import register_inverse, register_inverse_jvp
from jaxrev.transforms.reports import (
    MemoryReport,
    ReversibilityReport,
    check_reversible,
    memory_report,
)
from jaxrev.transforms.reverse import reverse
from jaxrev.transforms.reversible import reversible

__version__ = "0.1.0"

__all__ = [
    "reverse",
    "reversible",
    "memory_report",
    "MemoryReport",
    "register_inverse",
    "register_inverse_jvp",
    "check_reversible",
    "ReversibilityReport",
    "while_loop",
    "cond",
    "inverse_jvp",
    "inverse_vjp",
    "slogdet_jacobian",
    "forward_and_slogdet",
    "inverse_and_slogdet",
    "logdet_strategy",
    "register_logdet",
    "Bijector",
    "Chain",
    "custom_inverse",
    "hook",
    "nestlevel",
    "forward_mode",
    "store",
    "recompute",
    "optim",
    "rot",
    "swap",
    "apply_gate",
    "DtypeError",
    "JaxrevError",
    "NotConvergedError",
    "NotInvertibleError",
    "ReversibilityError",
    "SingularJacobianError",
    "DriftError",
    "DriftWarning",
    "RepairReport",
    "Exact",
    "LoopRepair",
    "FailureWarning",
    "PerformanceWarning",
    "jit",
    "raise_runtime_errors",
]


# Optional libraries whose code jaxrev's traces see marked (`_compat.on_trace`): while jaxrev
# traces, once the library is imported, its integration module supplies a context manager.
# That module imports the library, which jaxrev does not require, so it is imported by name
# then (after jaxrev itself: no import circle), once; one that fails to import (a library
# version without what it marks) marks nothing.
_LIBRARY_MARKS = {"flowjax": ("jaxrev.flowjax", "numerical_inverses_marked")}
_library_mark_fns: dict = {}


@_contextlib.contextmanager
def _library_marks():
    with _contextlib.ExitStack() as stack:
        for library, (module, name) in _LIBRARY_MARKS.items():
            if library not in _sys.modules:
                continue
            if library not in _library_mark_fns:
                try:
                    _library_mark_fns[library] = getattr(_importlib.import_module(module), name)
                except ImportError:
                    _library_mark_fns[library] = _contextlib.nullcontext
            stack.enter_context(_library_mark_fns[library]())
        yield


_on_trace(_library_marks)
