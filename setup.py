"""Builds sharpdraft: the C++ CPU extensions always (the attention kernel `sharpdraft_ext._C`, the
target runtime's ops `sharpdraft_ext._cpu_runtime`), the CUDA extension when possible.

Install with `pip install --no-build-isolation .` so the extensions are compiled against the torch
already installed (build isolation would fetch a different torch and break the ABI).

SHARPDRAFT_CUDA=auto (default) builds `sharpdraft_ext._cuda` when torch has CUDA and nvcc is
found; 1 requires it (fails with a message otherwise); 0 skips it. TORCH_CUDA_ARCH_LIST defaults
to "8.0;9.0a"; MAX_JOBS bounds the parallel compile jobs.
"""
import glob
import os
import shutil

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))


def _cxx_std():
    """C++17, or C++20 when the installed torch's headers demand it (torch >= 2.10)."""
    from torch.utils.cpp_extension import include_paths

    aten = os.path.join(include_paths()[0], "ATen", "ATen.h")
    try:
        with open(aten) as f:
            return "-std=c++20" if "C++20" in f.read() else "-std=c++17"
    except OSError:
        return "-std=c++17"


# -fopenmp: at::parallel_for is an inline OpenMP template; without it the kernel runs serially.
# (GOMP symbols resolve to the libgomp that torch itself loads.)
CXX_FLAGS = ["-O3", _cxx_std(), "-ffp-contract=fast", "-fopenmp", "-Wall", "-Wno-unknown-pragmas"]


def _settings():
    """python/sharpdraft/settings.py (standard library only), loaded by path: the package is not
    installed while it builds."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(
        "_sharpdraft_settings", os.path.join(ROOT, "python", "sharpdraft", "settings.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module           # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _cuda_wanted():
    try:
        mode = _settings().get("SHARPDRAFT_CUDA")
    except ValueError as err:
        raise SystemExit(str(err)) from None
    if mode == "0":
        return False
    import torch

    have_nvcc = shutil.which("nvcc") is not None or os.path.exists(
        os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc"))
    reasons = []
    if torch.version.cuda is None:
        reasons.append(f"the installed torch ({torch.__version__}) has no CUDA support")
    if not have_nvcc:
        reasons.append("nvcc was not found (set CUDA_HOME or put nvcc on PATH)")
    if reasons and mode == "1":
        raise SystemExit("SHARPDRAFT_CUDA=1 but the CUDA extension cannot be built: " + "; ".join(reasons))
    return not reasons


def _extensions():
    common = sorted(glob.glob("csrc/common/*.cpp"))
    attention = ["csrc/attention/ops.cpp"] + sorted(glob.glob("csrc/attention/cpu/*.cpp"))
    # the target runtime's ops: its own library (torch.ops.sharpdraft_cpu_runtime), which calls
    # the attention op through the dispatcher rather than compiling the kernel again
    runtime = sorted(glob.glob("csrc/cpu_runtime/*.cpp"))
    exts = [CppExtension(name, sources + common, include_dirs=[os.path.join(ROOT, "csrc")],
                         extra_compile_args={"cxx": CXX_FLAGS})
            for name, sources in (("sharpdraft_ext._C", attention),
                                  ("sharpdraft_ext._cpu_runtime", runtime))]
    cuda_sources = sorted(glob.glob("csrc/attention/cuda/*.cu")) + sorted(
        glob.glob("csrc/attention/cuda/*.cpp"))
    if cuda_sources and _cuda_wanted():
        from torch.utils.cpp_extension import CUDAExtension

        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0a")
        exts.append(CUDAExtension(
            "sharpdraft_ext._cuda", cuda_sources, include_dirs=[os.path.join(ROOT, "csrc")],
            extra_compile_args={
                "cxx": CXX_FLAGS,
                "nvcc": ["-O3", "-std=c++17", "--use_fast_math", "--expt-relaxed-constexpr",
                         "-Xptxas=-warn-spills"],
            }))
    return exts


setup(
    ext_modules=_extensions(),
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
