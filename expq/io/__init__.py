"""The bytes floor, importing nothing from expq but ``errors``: safetensors files (``safetensors``), the index and
which files hold the weights (``index``), content hashes (``hashing``), a local source's shards hashed while the
command line starts (``early_hash``), regular-file checks and bounded reads (``regular``), and how expq creates,
opens, deletes, renames and locks files without following links (``files``, with where a source's files may
resolve to: ``Inside``)."""
