"""Data: the built-in arithmetic task (and, later, TFDS/grain pipelines and math importers)."""
