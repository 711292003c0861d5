"""The Hugging Face Hub, both ways: ``download`` (a repo id → a local snapshot), ``stream`` (``--stream``: shards
downloaded as they are converted), ``push`` (a converted checkpoint → a model repo) with its model card (``card``),
``publish`` (``--ray --to-hub``: tasks upload their shards, the driver commits), and ``errors`` (the one translation
of a failed Hub call into expq's errors, for both ways).

The public names are importable from here: ``from expq.hub import push, model_card``. ``expq.hub.push`` is the
function; its module's other names come with ``from expq.hub.push import ...``.
"""

from .card import Install, install_line, model_card
from .push import PushError, PushReport, push

__all__ = ["push", "PushReport", "PushError", "model_card", "install_line", "Install"]
