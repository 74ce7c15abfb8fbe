"""vmoe's Hydra plug-in (the hydra_plugins namespace): the `parallel` launcher, which Hydra's
plug-in discovery finds, and the job it starts pinned to its cores (pinned_job.py). It imports the
runner package; the runner package imports nothing of it."""
