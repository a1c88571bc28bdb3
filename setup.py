"""Build libmpsshim.so (plain C, no Python inside) with the system C compiler.

The library is built by csrc/Makefile and placed inside the `shim` package, both for
`pip install .` (into the build tree) and for editable installs (into the source tree).
"""
import os
import subprocess

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

LIB = "libmpsshim.so"


class BuildShim(build_ext):
    def get_ext_filename(self, ext_name):
        return os.path.join(*ext_name.split(".")[:-1], LIB)

    def build_extension(self, ext):
        target = os.path.abspath(self.get_ext_fullpath(ext.name))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        here = os.path.dirname(os.path.abspath(__file__))
        subprocess.run(["make", "-C", os.path.join(here, "csrc"), f"OUT={target}", "lib"], check=True)


setup(
    ext_modules=[Extension("shim.libmpsshim", sources=[])],
    cmdclass={"build_ext": BuildShim},
)
