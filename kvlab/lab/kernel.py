"""The Jupyter kernel kvlab runs its notebooks on.

``make setup`` installs a kernelspec named ``kvlab`` into the project's environment, and
the notebooks name it, so papermill, nbval and JupyterLab all run the project's Python, and
a user-level ``python3`` kernel (another interpreter, other packages) cannot take over.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

from kvlab.atomic import atomic_write_text
from kvlab.errors import KernelMissing

KERNEL_NAME = "kvlab"
DISPLAY_NAME = "Python (kvlab)"
#: The kernel process logs only errors. At warning level ipykernel prints "Kernel is running
#: over TCP without encryption" at every start, through papermill, into every report and test
#: log; the kernel listens on localhost only. Warnings raised by code in cells are not logs
#: of the kernel application and still show.
KERNEL_ARGS = ["--IPKernelApp.log_level=ERROR"]


def kernel_name() -> str:
    """The kernel name to run notebooks with, after checking that its kernelspec exists.

    Raises
    ------
    KernelMissing
        No ``kvlab`` kernelspec is installed (``make setup`` installs it).
    """
    from jupyter_client.kernelspec import KernelSpecManager

    specs = KernelSpecManager().find_kernel_specs()
    if KERNEL_NAME not in specs:
        raise KernelMissing(
            f"no Jupyter kernelspec named {KERNEL_NAME!r} (found: {', '.join(sorted(specs)) or 'none'}); "
            "`make setup` installs it (python -m ipykernel install --sys-prefix --name kvlab "
            "--display-name 'Python (kvlab)')"
        )
    return KERNEL_NAME


def install(prefix: str = sys.prefix) -> Path:
    """Install the ``kvlab`` kernelspec into ``prefix`` (this environment): this Python, quiet start-up.

    Returns
    -------
    Path
        The kernelspec folder.
    """
    from ipykernel.kernelspec import install as ipykernel_install

    folder = Path(ipykernel_install(kernel_name=KERNEL_NAME, display_name=DISPLAY_NAME, prefix=prefix))
    spec = json.loads((folder / "kernel.json").read_text())
    spec["argv"] = [a for a in spec["argv"] if a not in KERNEL_ARGS] + KERNEL_ARGS
    atomic_write_text(folder / "kernel.json", json.dumps(spec, indent=1) + "\n")
    return folder


@functools.cache
def quiet_kernel_manager() -> type:
    """The kernel manager class kvlab's papermill runs start their kernels with.

    jupyter_client sends SIGINT before every shutdown request, to break off code that is
    still running. A kernel that has finished its last cell is idle, or nearly: the signal can
    land while it is still sending the last reply, and ipykernel then logs ``KeyboardInterrupt
    caught in kernel.`` at error level, on the terminal of whoever ran the report, about
    nothing. This manager sends no SIGINT while shutting down; the shutdown request alone stops
    an idle kernel, and jupyter_client kills one that does not answer it (after its
    ``shutdown_wait_time``). An interrupt asked for at any other time (a cell's timeout) is sent.
    """
    from jupyter_client import AsyncKernelManager

    class QuietShutdownKernelManager(AsyncKernelManager):
        async def _async_interrupt_kernel(self) -> None:
            if self.shutting_down:
                return
            await super()._async_interrupt_kernel()

    return QuietShutdownKernelManager
