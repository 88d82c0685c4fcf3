"""The megatron-core training backend (``MegatronBackend``) and its CPU compatibility layer.

Importing this package checks the environment first and fails with one clear message when
megatron-core is missing or when TransformerEngine's empty meta package is installed (then
``import transformer_engine`` raises RuntimeError, which megatron does not catch, so any
``import megatron.core`` would crash with a confusing traceback).
"""

from __future__ import annotations

import importlib.util


class MegatronUnavailableError(ImportError):
    """megatron-core cannot be used in this environment (the message says how to fix it)."""


def check_environment() -> None:
    """Raise MegatronUnavailableError if megatron-core is missing or TE is a broken install."""
    if importlib.util.find_spec("transformer_engine") is not None:
        try:
            import transformer_engine  # noqa: F401
        except ImportError:
            pass  # megatron treats an ImportError as "no TE" and falls back to its local spec
        except Exception as e:  # the empty meta package raises RuntimeError
            raise MegatronUnavailableError(
                "transformer_engine is installed but cannot be imported "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); this is "
                "usually the empty `transformer-engine` meta package without its CUDA wheels, "
                "and it makes `import megatron.core` crash. Uninstall it "
                "(`pip uninstall transformer-engine`) to use megatron's local spec, or install "
                "the full TransformerEngine for your CUDA (`pip install transformer-engine[pytorch]`)"
            ) from e
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec(
        "megatron.core"
    ) is None:
        raise MegatronUnavailableError(
            "megatron-core is not installed: pip install megarl[megatron] "
            "(megatron-core==0.16.1 on Python 3.11)"
        )


check_environment()

from megarl.backends.megatron.backend import MegatronBackend  # noqa: E402
from megarl.backends.megatron.optim import OptimSettings  # noqa: E402

__all__ = ["MegatronBackend", "MegatronUnavailableError", "OptimSettings", "check_environment"]
