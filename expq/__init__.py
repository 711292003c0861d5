"""expq: exact experts-only int8 (vLLM ``experts_int8``) conversion of Hugging Face Mixture-of-Experts checkpoints.

Python API (the CLI ``expq`` is a thin layer over it):

* ``expq.convert(src, out, ...) -> ConvertReport`` and ``expq.inspect(src, ...) -> Plan``
* ``expq.verify(out, source=None, ...) -> VerifyReport``
* ``expq.load_model(path, ...)`` and ``expq.load_experts(path, layer=None)``
* ``expq.push(out, repo_id, ...)``
"""

from .version import __version__

_EXPORTS = {
    "convert": "api", "inspect": "api", "ConvertReport": "api",
    "verify": "verifier", "VerifyReport": "verifier",
    "load_model": "runtime", "load_experts": "runtime",
    "push": "hub",
    "ExpqError": "errors",
}

__all__ = list(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'expq' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"expq.{mod}"), name)


def _register_with_transformers() -> None:
    try:
        from .engines.transformers import register
    except ImportError:  # pragma: no cover - transformers is a dependency
        return
    register()


from .engines import after_import as _after_import  # noqa: E402

_after_import("transformers", _register_with_transformers)
