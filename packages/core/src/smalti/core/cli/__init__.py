"""Command-line entry points: ``smalti-train`` (a Hydra app) and ``smalti`` (plugin inspection)."""
