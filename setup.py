"""The kernels' sources (csrc/: CPU C++ and CUDA, built on the host at run time) ship inside
the package as `blockserve/csrc/`, so that a wheel or a non-editable install builds them too
(blockserve/kernels/sources.py finds them there, or in a checkout's csrc/)."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithKernelSources(build_py):
    def run(self) -> None:
        super().run()
        if not self.editable_mode:
            target = Path(self.build_lib) / "blockserve" / "csrc"
            for kind in ("cpu", "cuda"):
                self.copy_tree(str(Path("csrc") / kind), str(target / kind))


setup(cmdclass={"build_py": BuildPyWithKernelSources})
