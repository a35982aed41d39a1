"""jgrpo: JAX/TPU-native GRPO, on-policy and off-policy (arXiv 2505.22257). The rooms: docs/architecture.md.

Importing the package does two things. For one release, the module paths before the rooms (`jgrpo.trainer`,
`jgrpo.sampler`, ...) keep working, with a warning (`jgrpo._moved`). And it decides one thing before jax is
imported: on a machine with libtpu installed (the
`tpu` extra, which `jgrpo.plan` uses to compile for TPUs deviceless) but no TPU attached, jax would try the TPU
first and print initialisation errors before falling back to the CPU. There, unless the user chose with
JAX_PLATFORMS, jgrpo runs on the CPU quietly. A TPU VM (a Google PCI device) or a CUDA plugin leaves jax to
choose as usual. Without torch installed (the quickstart's install), it also keeps transformers from advising
that "models won't be available": jgrpo uses transformers for tokenizers only.
"""

import glob
import importlib.util
import os

_GOOGLE_PCI_VENDOR = "0x1ae0"  # TPU chips appear as PCI devices of this vendor on Cloud TPU VMs


def tpu_attached() -> bool:
    """Whether this machine has a TPU chip on its PCI bus (a Cloud TPU VM)."""
    for path in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            with open(path) as f:
                if f.read().strip() == _GOOGLE_PCI_VENDOR:
                    return True
        except OSError:
            continue
    return False


def _quiet_cpu_when_libtpu_has_no_tpu() -> None:
    if "JAX_PLATFORMS" in os.environ or importlib.util.find_spec("libtpu") is None:
        return
    if any(importlib.util.find_spec(p) for p in ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm_plugin")):
        return
    if not tpu_attached():
        os.environ["JAX_PLATFORMS"] = "cpu"


_quiet_cpu_when_libtpu_has_no_tpu()
if importlib.util.find_spec("torch") is None:
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from jgrpo import _moved  # noqa: E402 - after the platform is settled; it imports nothing else of jgrpo

_moved.install()
