"""batchlab: a reproducible, tracked training pipeline for tabular classifiers."""

__version__ = "0.1.0"
