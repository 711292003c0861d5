"""Engine integrations for expq checkpoints: transformers (``engines.transformers``), vLLM (``engines.vllm``, with the
pure-torch loading it uses in ``engines.moe_loading``), and which engine loads what (``engines.clients``).

``after_import(name, fn)`` runs ``fn`` once module ``name`` has been imported (now, if it already is), so that
``import expq`` can register with transformers without importing it.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Callable


class _AfterImport(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, fn: Callable[[], None]):
        self.name, self.fn = name, fn

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module, fn = spec.loader.exec_module, self.fn

        def exec_then_register(module):
            exec_module(module)
            fn()

        spec.loader.exec_module = exec_then_register
        return spec


def after_import(name: str, fn: Callable[[], None]) -> None:
    """Call ``fn()`` right after module ``name`` is first imported, or now if it already is."""
    if name in sys.modules:
        fn()
    elif not any(isinstance(f, _AfterImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, fn))
