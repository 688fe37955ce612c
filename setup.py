"""Build the C core and its Cython layer (mploader._ring) with the normal build.

Warnings policy: users' installs (pip install from the sdist, on whatever compiler and
Cython release they have) compile with ``-Wall -Wextra`` only, so that a new warning of a
newer toolchain is a warning, not a failed install.  Our own builds (``make``, CI) set
``MPLOADER_WERROR=1`` and compile with ``-Werror`` on top: the C core and the generated
code compile without a warning with the pinned Cython and gcc 12, and must stay so.
"""
import os

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

WARNINGS = ["-Wall", "-Wextra"]
if os.environ.get("MPLOADER_WERROR", "") not in ("", "0"):
    WARNINGS.append("-Werror")
# Should a newer Cython emit a warning under -Werror, add the narrowest -Wno-<name> here
# with a comment saying which generated construct needs it.
C_FLAGS = ["-std=c11", "-O2", *WARNINGS]

ext = Extension(
    "mploader._ring",
    sources=["mploader/_ring.pyx", "csrc/ring.c", "csrc/region.c", "csrc/proc.c"],
    include_dirs=["csrc"],
    # -pthread: proc.c starts a thread (watch_parent) and uses pthread_once/pthread_atfork.
    extra_compile_args=[*C_FLAGS, "-pthread"],
    extra_link_args=["-pthread"],
)

# The opcode scan that bounds in-band pickles before they are unpickled
# (mploader/_inband.py); plain Cython, no C core, the same warnings policy.
scan = Extension(
    "mploader._pickle_scan",
    sources=["mploader/_pickle_scan.pyx"],
    extra_compile_args=C_FLAGS,
)

# The per-batch steps at C speed, one module per role (each plain Cython over the C
# library; the numpy ones read arrays' shape and dtype through NumPy's C API).
NUMPY_C = {"include_dirs": ["csrc", numpy.get_include()],
           "define_macros": [("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")]}
roles = [
    # the wire format: task records, their framing, the pipe writes
    Extension("mploader._protocol", sources=["mploader/_protocol.pyx"], extra_compile_args=C_FLAGS),
    # the scheduler's steps that an interrupt must not split (cimports _protocol's write loop)
    Extension("mploader._steps", sources=["mploader/_steps.pyx"], extra_compile_args=C_FLAGS),
    # generator states seeded and read in place (NumPy's bitgen_t, from numpy/random/bitgen.h)
    Extension("mploader._rng_memory", sources=["mploader/_rng_memory.pyx"], extra_compile_args=C_FLAGS,
              include_dirs=[numpy.get_include()]),
    # collation checks, row copies (csrc/memops.c's streaming stores), batch plans
    Extension("mploader._columns", sources=["mploader/_columns.pyx", "csrc/memops.c"],
              extra_compile_args=C_FLAGS, **NUMPY_C),
    # madvise of the region's pages (csrc/memops.c), for CUDA pinning
    Extension("mploader._memops", sources=["mploader/_memops.pyx", "csrc/memops.c"],
              include_dirs=["csrc"], extra_compile_args=C_FLAGS),
]

setup(ext_modules=cythonize([ext, scan, *roles], language_level=3,
                           compiler_directives={"boundscheck": False, "wraparound": False}))
