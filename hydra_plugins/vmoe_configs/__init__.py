"""vmoe's config source (the hydra_plugins namespace): Hydra's plug-in discovery finds it and the
search path entry that names it. It imports the runner package; the runner package imports
nothing of it."""
