"""Kernel benchmark suite (``python -m tessel.bench``) and the end-to-end training benchmark."""
