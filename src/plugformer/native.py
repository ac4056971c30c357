"""Native kernels: C sources shipped in `plugformer/csrc`, built at first use with the machine's C compiler and loaded
with ctypes, for the few loops that no torch operation fuses (additive attention's tanh over (rows, keys, A)).

A build is cached per source, compiler, flags and CPU (`-march=native` code may not run on another CPU, and a home
directory may be shared by several machines), in `$PLUGFORMER_NATIVE_CACHE` or `~/.cache/plugformer/native`, written
atomically (a temporary file renamed into place), so concurrent processes never load a half-written library. Where
no compiler is found, the build fails or the library does not load, `load` returns `None` with one warning and the
callers keep their torch path, which computes the same numbers. `PLUGFORMER_NATIVE_KERNELS=0` turns them off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path


logger = logging.getLogger(__name__)

SWITCH = "PLUGFORMER_NATIVE_KERNELS"
CACHE = "PLUGFORMER_NATIVE_CACHE"
SOURCES = Path(__file__).with_name("csrc")
# -fno-trapping-math: the kernels read no floating-point exception flags, and with them GCC keeps a select between two
# computed floats (a clamp, a masked weight) a branch where the CPU has no mask registers (AVX2), and the loop around
# it scalar (BENCHMARKS.md, "Design measurements")
FLAGS = ("-O3", "-march=native", "-std=c11", "-fno-trapping-math", "-fPIC", "-shared", "-pthread")
# Tried in order: OpenMP, whose libgomp.so.1 is torch's own where torch loaded one by that name (its Linux wheels
# bundle it), so the kernels run on torch's thread pool (`csrc/parallel.h`); else no runtime (`omp simd` loops still
# vectorised) and POSIX threads, where the compiler has no OpenMP (Apple's clang)
THREADING = (("-fopenmp",), ("-fopenmp-simd",))
# -z now resolves every symbol at load, so a missing one is an OSError there, not a crash at the first call;
# macOS' linker has no -z now (and refuses a missing symbol when it links)
LINK_FLAGS = () if platform.system() == "Darwin" else ("-Wl,-z,now",)
BUILD_SECONDS = 300


def compiler() -> list[str] | None:
    """The C compiler command: `$CC`, else the one Python was built with, else `cc` or `gcc` on the PATH."""
    for candidate in (os.environ.get("CC"), sysconfig.get_config_var("CC"), "cc", "gcc"):
        command = shlex.split(candidate) if candidate else []
        if command and shutil.which(command[0]):
            return command
    return None


def _cpu_identity() -> str:
    """What `-march=native` depends on: the CPU's model and feature flags where Linux lists them."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    wanted = ("model name", "flags", "Features", "CPU implementer", "CPU part")
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in wanted}))


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (x86's `flags`, Arm's `Features`); empty where it does not."""
    return frozenset(
        flag
        for line in _cpu_identity().splitlines()
        if line.split(":")[0].strip() in ("flags", "Features")
        for flag in line.partition(":")[2].split()
    )


def _version(command: list[str]) -> str:
    try:
        result = subprocess.run([*command, "--version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return result.stdout


def cache_dir() -> Path:
    if os.environ.get(CACHE):
        return Path(os.environ[CACHE])
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "plugformer" / "native"


def library_path(name: str, command: list[str], threading: tuple[str, ...] = THREADING[0]) -> Path:
    """Where the build of `csrc/<name>.c` by `command` with `threading`'s flags for this CPU lives: keyed by a hash of
    all that shapes it."""
    headers = [path.read_text() for path in sorted(SOURCES.glob("*.h"))]  # what the sources include
    parts = [
        (SOURCES / f"{name}.c").read_text(),
        *headers,
        *command,
        _version(command),
        *FLAGS,
        *threading,
        *LINK_FLAGS,
        platform.machine(),
        platform.system(),
        " ".join(platform.libc_ver()),
        _cpu_identity(),
    ]
    digest = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]
    return cache_dir() / f"{name}-{digest}.so"


def build(name: str, command: list[str], target: Path, threading: tuple[str, ...] = THREADING[0]) -> None:
    """Compiles `csrc/<name>.c` with `threading`'s flags into `target` atomically; raises `RuntimeError` with the
    compiler's output."""
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{name}-", suffix=".so")
    os.close(handle)
    try:
        argv = [*command, *FLAGS, *threading, str(SOURCES / f"{name}.c"), "-o", temporary, *LINK_FLAGS, "-lm"]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=BUILD_SECONDS, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"`{shlex.join(argv)}` exited {result.returncode}: {result.stderr.strip()[-2000:]}")
        os.replace(temporary, target)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


@functools.cache
def load(name: str) -> ctypes.CDLL | None:
    """The library built from `csrc/<name>.c` (built now unless cached), or `None` where native kernels are off
    (`PLUGFORMER_NATIVE_KERNELS=0`), on Windows, or where no compiler builds it or the build does not load (warned
    once per process). Cached per process."""
    if os.environ.get(SWITCH, "1").strip().lower() in ("0", "false", "no", "off") or platform.system() == "Windows":
        return None
    if not (SOURCES / f"{name}.c").is_file():  # a checkpoint's copy of plugformer (`trust_remote_code`) has no csrc/
        logger.info("plugformer: no source for the native %s kernel here: it runs on its torch path", name)
        return None
    command = compiler()
    if command is None:
        logger.warning("plugformer: no C compiler found ($CC, cc, gcc): the %s kernel runs on its torch path", name)
        return None
    errors = []
    for threading in THREADING:
        try:
            target = library_path(name, command, threading)
            if not target.exists():
                build(name, command, target, threading)
            return ctypes.CDLL(str(target), mode=os.RTLD_NOW | os.RTLD_LOCAL)
        except (OSError, RuntimeError, subprocess.SubprocessError) as error:
            errors.append(f"{' '.join(threading)}: {error}")
    logger.warning(
        "plugformer: the native %s kernel is unavailable (%s): it runs on its torch path", name, "; ".join(errors)
    )
    return None
