"""The kernel: the system of record for executions, steps, dispatches and events."""

from ._api import KernelAPI
from ._dispatcher import Dispatcher
from ._manifest import ManifestAgent, ManifestError, load_manifest
from ._runner import KernelConfig, RunningKernel, serve_kernel
from ._service import Kernel

__all__ = [
    "Dispatcher",
    "Kernel",
    "KernelAPI",
    "KernelConfig",
    "ManifestAgent",
    "ManifestError",
    "RunningKernel",
    "load_manifest",
    "serve_kernel",
]
