"""Datasets, data preparation to MDS and synthetic data for language models."""
