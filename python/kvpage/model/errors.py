"""Errors raised while reading a model checkpoint (config, weight files, parameter trees)."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A model directory, config file, weight file or parameter tree is missing or invalid.

    The message always names the offending file or tensor.
    """
