"""Hydra plugins shipped with smalti-core (Hydra scans ``hydra_plugins.*`` packages, so this needs an ``__init__``)."""
