"""The Jupyter kernel kvlab runs its notebooks on.

``make setup`` installs a kernelspec named ``kvlab`` into the project's environment, and
the notebooks name it, so papermill, nbval and JupyterLab all run the project's Python, and
a user-level ``python3`` kernel (another interpreter, other packages) cannot take over.
"""
from __future__ import annotations

from .errors import KernelMissing

KERNEL_NAME = "kvlab"


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
            "--display-name 'Python (kvlab)')")
    return KERNEL_NAME
