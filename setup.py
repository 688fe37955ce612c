"""Build the C core and its Cython layer (mploader._ring) with the normal build."""
import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

ext = Extension(
    "mploader._ring",
    sources=["mploader/_ring.pyx", "csrc/ring.c", "csrc/region.c", "csrc/proc.c"],
    include_dirs=["csrc"],
    # -Wall -Wextra -Werror for csrc/*.c and for the Cython-generated mploader/_ring.c
    # alike: the generated code compiles without a warning with Cython 3.3 and gcc 12, so
    # no -Wno-... is needed today.  Should a newer Cython emit one, add the narrowest
    # -Wno-<name> here with a comment saying which generated construct needs it.
    # -pthread: proc.c starts a thread (watch_parent) and uses pthread_once/pthread_atfork.
    extra_compile_args=["-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", "-pthread"],
    extra_link_args=["-pthread"],
)

# The opcode scan that bounds in-band pickles before they are unpickled
# (mploader/_inband.py); plain Cython, no C core, the same warnings policy.
scan = Extension(
    "mploader._pickle_scan",
    sources=["mploader/_pickle_scan.pyx"],
    extra_compile_args=["-std=c11", "-O2", "-Wall", "-Wextra", "-Werror"],
)

# The per-batch bookkeeping (task records, signal mask, pipe writes): plain Cython.
hot = Extension(
    "mploader._hot",
    sources=["mploader/_hot.pyx"],
    include_dirs=[numpy.get_include()],  # the collation checks read arrays' shape and dtype
    define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    extra_compile_args=["-std=c11", "-O2", "-Wall", "-Wextra", "-Werror"],
)

setup(ext_modules=cythonize([ext, scan, hot], language_level=3,
                           compiler_directives={"boundscheck": False, "wraparound": False}))
