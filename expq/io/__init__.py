"""The bytes floor: safetensors files (``safetensors``), the index and which files hold the weights (``index``),
content hashes (``hashing``). Imports nothing from expq but ``errors``."""
