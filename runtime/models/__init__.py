"""Models built on ``runtime.Tensor``: ``MiniLM`` (sentence-transformers/all-MiniLM-L6-v2).

Model files are read from local directories only; see ``runtime.models.minilm``.
"""

from .minilm import MiniLM, default_model_dir

__all__ = ["MiniLM", "default_model_dir"]
