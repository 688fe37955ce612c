"""Build the C core and its Cython layer (mploader._ring) with the normal build."""
from Cython.Build import cythonize
from setuptools import Extension, setup

ext = Extension(
    "mploader._ring",
    sources=["mploader/_ring.pyx", "csrc/ring.c"],
    include_dirs=["csrc"],
    extra_compile_args=["-std=c11", "-O2", "-Wall"],
)

setup(ext_modules=cythonize([ext], language_level=3, compiler_directives={"boundscheck": False, "wraparound": False}))
