"""Python handle to mambafuse's ONNX Runtime custom-op library (``ai.mambafuse`` domain).

``library_path()`` is the one place that knows where the shared library lives; ``register()`` adds it
to a ``SessionOptions``; ``session()`` builds an ``InferenceSession`` with it registered.

Registering the library makes its kernels shadow the model-local function that a fused model carries.
That is what you want on the CPU and CUDA providers; on providers that cannot host custom ops
(CoreML), leave it unregistered so ONNX Runtime inlines the function's stock-op body instead.
"""

from __future__ import annotations

import os
import sys
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import onnx
    import onnxruntime

DOMAIN = "ai.mambafuse"
OP_TYPE = "GatedGroupRMSNorm"
LIBRARY_ENV = "MAMBAFUSE_LIBRARY"

_LIBRARY_NAMES = {
    "linux": "libmambafuse_ops.so",
    "darwin": "libmambafuse_ops.dylib",
    "win32": "mambafuse_ops.dll",
}
#: Providers that cannot run a custom-op kernel: the fused node must reach them as its function body.
PROVIDERS_WITHOUT_CUSTOM_OPS = frozenset({"CoreMLExecutionProvider"})
#: The session config entry that turns the prefill ops' CPU kernels (MambaChunkScan, CausalConv1d: no GPU kernels
#: yet) off. ``session`` sets it to "0" when the preferred provider is not the CPU's: ONNX Runtime would otherwise
#: run those nodes on the CPU kernel and copy the prompt's tensors across; without a kernel it inlines their
#: model-local functions on the GPU.
PREFILL_CPU_KERNELS_KEY = "mambafuse.prefill_cpu_kernels"


class LibraryNotFoundError(FileNotFoundError):
    """The custom-op library is not built or not installed where mambafuse looks for it."""


def _library_name() -> str:
    return _LIBRARY_NAMES.get(sys.platform, _LIBRARY_NAMES["linux"])


def _candidates() -> list[Path]:
    name = _library_name()
    here = Path(__file__).resolve().parent
    found: list[Path] = []
    env = os.environ.get(LIBRARY_ENV)
    if env:
        found.append(Path(env))
    # An installed wheel (and scikit-build-core's editable install) puts the library inside the package.
    for entry in list(getattr(sys.modules[__name__], "__path__", [])) + [str(here)]:
        found.append(Path(entry) / name)
    # A standalone CMake build in the source tree: `cmake -S contrib_ops -B build/cmake`.
    repo = here.parent
    found.append(repo / "build" / "cmake" / name)
    found.extend(sorted((repo / "build").glob(f"*/{name}")))
    seen: set[Path] = set()
    unique = []
    for path in found:
        if path not in seen:
            seen.add(path)
            unique.append(path)
    return unique


def library_path() -> str:
    """Return the path of the custom-op shared library, or raise LibraryNotFoundError.

    Looks at ``$MAMBAFUSE_LIBRARY`` (when set it must exist), then inside the installed package, then
    in a standalone CMake build under ``build/``. The error lists every place it looked.
    """
    env = os.environ.get(LIBRARY_ENV)
    if env:
        if Path(env).is_file():
            return str(Path(env).resolve())
        raise LibraryNotFoundError(f"${LIBRARY_ENV} is set to {env!r}, which is not a file")
    candidates = _candidates()
    for path in candidates:
        if path.is_file():
            return str(path)
    looked = "\n  ".join(str(p) for p in candidates)
    raise LibraryNotFoundError(
        f"mambafuse custom-op library {_library_name()} not found. Looked in:\n  {looked}\n"
        "Build it with `make build` (or `pip install -e .`), or set $"
        f"{LIBRARY_ENV} to its path."
    )


def cpu_isa() -> str:
    """Return the instruction-set variant the CPU kernel runs in this process (e.g. "avx512", "neon").

    ``MAMBAFUSE_CPU_ISA=baseline|avx2|avx512`` (set before the library is first used) forces a lower one.
    """
    import ctypes

    library = ctypes.CDLL(library_path())
    library.MambafuseCpuIsa.restype = ctypes.c_char_p
    return library.MambafuseCpuIsa().decode()


def has_cuda_kernels() -> bool:
    """Return whether the library was built with its CUDA kernels (``MAMBAFUSE_CUDA=ON``)."""
    import ctypes

    return bool(ctypes.CDLL(library_path()).MambafuseCudaKernels())


#: SessionOptions that already hold the library: ONNX Runtime refuses a second registration of the
#: domain ("Domain already set in registry"), so registering is made idempotent here.
_REGISTERED: weakref.WeakSet[onnxruntime.SessionOptions] = weakref.WeakSet()


def register(session_options: onnxruntime.SessionOptions) -> onnxruntime.SessionOptions:
    """Register the library's kernels in ``session_options`` (once; again is a no-op) and return it."""
    if session_options not in _REGISTERED:
        session_options.register_custom_ops_library(library_path())
        _REGISTERED.add(session_options)
    return session_options


def _has_config_entry(options: onnxruntime.SessionOptions, key: str) -> bool:
    try:
        options.get_session_config_entry(key)
    except RuntimeError:  # ORT raises for a key it does not have
        return False
    return True


def wants_library(providers: Sequence[Any] | None) -> bool:
    """Return whether a session on ``providers`` should register the library.

    False when the first (preferred) provider cannot host custom ops (CoreML): registering would
    shadow the model-local function and split the provider's partition around the fused node.
    """
    if not providers:
        return True
    first = providers[0][0] if isinstance(providers[0], tuple) else providers[0]
    return first not in PROVIDERS_WITHOUT_CUSTOM_OPS


def session(
    model: str | os.PathLike[str] | bytes | onnx.ModelProto,
    providers: Sequence[Any] | None = None,
    session_options: onnxruntime.SessionOptions | None = None,
    *,
    use_library: bool | None = None,
) -> onnxruntime.InferenceSession:
    """Return an ``InferenceSession`` for ``model`` with the library registered where it belongs.

    ``use_library=None`` decides by provider (see ``wants_library``); True/False forces it.
    ``providers`` defaults to the CPU provider.
    """
    import onnxruntime as ort

    providers = list(providers) if providers else ["CPUExecutionProvider"]
    options = session_options if session_options is not None else ort.SessionOptions()
    if use_library if use_library is not None else wants_library(providers):
        first = providers[0][0] if isinstance(providers[0], tuple) else providers[0]
        if first != "CPUExecutionProvider" and not _has_config_entry(options, PREFILL_CPU_KERNELS_KEY):
            options.add_session_config_entry(PREFILL_CPU_KERNELS_KEY, "0")
        register(options)
    if hasattr(model, "SerializeToString"):
        model = model.SerializeToString()  # type: ignore[union-attr]
    elif isinstance(model, os.PathLike):
        model = os.fspath(model)
    return ort.InferenceSession(model, sess_options=options, providers=providers)
