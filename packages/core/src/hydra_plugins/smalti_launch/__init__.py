"""smalti's Hydra launchers (Hydra builds launchers only from ``hydra_plugins.*`` packages, so they live here)."""
