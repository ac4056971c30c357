"""What a number ran on: the CPU and the instruction set torch dispatches to, the libraries and their versions, the
processes and threads. Floating-point sums round differently with AVX2 and AVX-512 kernels (and another BLAS, another
thread count), so one seed's training follows another trajectory on another CPU: a result names its machine.

Nothing here measures anything (the pipeline's `machine_speed` does): recording it costs well under a millisecond.
"""

from __future__ import annotations

import os
import platform
import re
from importlib import metadata


# the libraries a training run's numbers depend on, besides torch (recorded by their installed versions)
LIBRARIES = ("transformers", "trl", "accelerate", "peft", "datasets")


def cpu_model() -> str:
    """The CPU's model name: `model name` of /proc/cpuinfo (Linux), else `platform.processor()` (may be empty)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def blas_text(config: str) -> str | None:
    """The BLAS torch was built with, from `torch.__config__.show()`: `BLAS_INFO` with the MKL or OpenBLAS version
    where the build names one.

    >>> blas_text("Intel(R) oneAPI Math Kernel Library Version 2024.2-Product Build 20240605, BLAS_INFO=mkl, ...")
    'mkl 2024.2'
    >>> blas_text("Build settings: BLAS_INFO=open, LAPACK_INFO=open"), blas_text("no build settings")
    ('open', None)
    """
    info = re.search(r"BLAS_INFO=([^,\s]+)", config)
    version = re.search(r"(?:Math Kernel Library Version|OpenBLAS) (\d[\d.]*)", config)
    parts = [match.group(1) for match in (info, version) if match is not None]
    return " ".join(parts) or None


def library_version(name: str) -> str | None:
    """The installed version of the distribution `name`, or None when it is not installed."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def environment_record(world_size: int) -> dict:
    """What a result ran on, for `run_info.json`, `plugformer eval`'s results and the experiments' `results.json`.

    Args:
        world_size (`int`): The number of processes the run used (1 without `accelerate launch`).

    Returns:
        `dict`: `cpu` (model name), `cpu_capability` (the instruction set torch's ATen kernels dispatch to:
        `torch.backends.cpu.get_cpu_capability()`), `aten_cpu_capability` (the `ATEN_CPU_CAPABILITY` variable that
        lowers it, None when unset), `torch`, `blas`, the versions of `LIBRARIES`, `python`, `platform`,
        `world_size`, `torch_threads` (`torch.get_num_threads()`) and `omp_num_threads` (the variable, None when
        unset).
    """
    import torch

    return {
        "cpu": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "aten_cpu_capability": os.environ.get("ATEN_CPU_CAPABILITY"),
        "torch": torch.__version__,
        "blas": blas_text(torch.__config__.show()),
        **{name: library_version(name) for name in LIBRARIES},
        "python": platform.python_version(),
        "platform": platform.platform(),
        "world_size": world_size,
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }


def environment_text(record: dict) -> str:
    """One line naming the CPU and torch of an `environment_record`, e.g. `AMD EPYC (AVX2), torch 2.13.0 (mkl
    2024.2), 1 thread`."""
    threads = record.get("torch_threads")
    blas = f" ({record['blas']})" if record.get("blas") else ""
    return (
        f"{record.get('cpu') or 'an unnamed CPU'} ({record.get('cpu_capability')}), torch {record.get('torch')}"
        f"{blas}" + (f", {threads} thread{'s' if threads != 1 else ''}" if threads else "")
    )
