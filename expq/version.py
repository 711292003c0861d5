"""expq's version: the one place it is written (``pyproject.toml`` reads it from here; ``expq.__version__``, the
manifest and the formats' ``quantization_config`` import it). Imports nothing."""

__version__ = "0.1.0"
