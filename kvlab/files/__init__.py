"""Cache files: the producer's fingerprint, the on-disk format, and saving and loading against a model."""
