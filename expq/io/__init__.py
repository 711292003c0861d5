"""Bytes on disk: how expq creates, opens, deletes, renames and locks files (``files``)."""
