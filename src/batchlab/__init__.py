"""batchlab: a reproducible, tracked training pipeline for classifiers of feature rows, images and token sequences."""

__version__ = "0.1.0"
