"""Only the optional C extension; everything else is in pyproject.toml.

``optional=True``: where it cannot be compiled (no C compiler), the install goes on without it
and envfleet runs its Python step path (see src/envfleet/_core/native.py).
"""

import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class BuildExt(build_ext):
    """Compile every time, from nothing: a ``build/`` left by an earlier build holds that
    build's ``.so``, which setuptools would find up to date and not rebuild, and ship even
    where this build has no compiler. Removed first, a failed optional build leaves no
    extension behind, and envfleet runs its Python path."""

    def build_extension(self, ext: Extension) -> None:
        target = self.get_ext_fullpath(ext.name)
        if os.path.exists(target):
            os.remove(target)
        super().build_extension(ext)


setup(
    cmdclass={"build_ext": BuildExt},
    ext_modules=[
        Extension(
            "envfleet._core._speedups",
            sources=["src/envfleet/_core/_speedups.c"],
            extra_compile_args=["-O2"],
            optional=True,
        )
    ],
)
