"""vmoe's Hydra launchers (found by Hydra's plugin discovery in the hydra_plugins namespace)."""
