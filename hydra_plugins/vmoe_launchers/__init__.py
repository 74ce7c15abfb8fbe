"""vmoe's Hydra plug-ins (the hydra_plugins namespace): the `parallel` launcher, which
Hydra's plug-in discovery finds, and the table a sweep prints when it ends (a callback that
conf/hydra/env/vmoe.yaml names)."""
