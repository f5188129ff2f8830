"""Which JAX backends a host can run, decided before JAX starts them.

JAX starts every backend it finds installed. With libtpu installed (the ``tpu`` extra, part of ``dev``: it is what
``python -m jaxpt.tools.compile`` compiles TPU topologies with) on a host that has no TPU, starting the TPU backend
fails, and libtpu prints ``Failed to find host bounds ...`` and ``E0000 ... INVALID_ARGUMENT`` lines on every
command. :func:`select_cpu_without_accelerators` (called when ``jaxpt`` is imported) sets ``JAX_PLATFORMS=cpu`` when
the host has no accelerator on its PCI bus (no Google TPU, NVIDIA or AMD GPU), the only backend such a host can run
anyway. An explicitly set ``JAX_PLATFORMS`` is never changed; ``JAXPT_AUTO_PLATFORMS=0`` turns the choice off.
"""

from __future__ import annotations

import glob
import os

#: PCI vendor ids of accelerators JAX has backends for: Google (TPU), NVIDIA, AMD/ATI (GPU).
ACCELERATOR_VENDORS = frozenset({"0x1ae0", "0x10de", "0x1002"})


def pci_vendors(root: str = "/sys/bus/pci/devices") -> set[str] | None:
    """The PCI vendor ids (``'0x10de'``) of the host's devices, or None where the host does not list them (not
    Linux, or no ``/sys``)."""
    paths = glob.glob(os.path.join(root, "*", "vendor"))
    if not paths:
        return None
    vendors = set()
    for p in paths:
        try:
            with open(p) as f:
                vendors.add(f.read().strip().lower())
        except OSError:
            continue
    return vendors


def select_cpu_without_accelerators(environ=os.environ, root: str = "/sys/bus/pci/devices") -> bool:
    """Set ``JAX_PLATFORMS=cpu`` in ``environ`` when it is unset, not turned off (``JAXPT_AUTO_PLATFORMS=0``) and the
    host's PCI bus has no accelerator (:data:`ACCELERATOR_VENDORS`). Returns whether it set it. Must run before JAX
    starts its backends (it reads the variable then)."""
    if environ.get("JAX_PLATFORMS") or environ.get("JAXPT_AUTO_PLATFORMS", "1").strip() in ("0", "false", "no"):
        return False
    vendors = pci_vendors(root)
    if vendors is None or vendors & ACCELERATOR_VENDORS:
        return False
    environ["JAX_PLATFORMS"] = "cpu"
    return True
