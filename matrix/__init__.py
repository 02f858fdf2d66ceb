"""logit-matrix: one set of token ids, every inference stack, full-vocab logits in a warehouse."""

__version__ = "0.1.0"
