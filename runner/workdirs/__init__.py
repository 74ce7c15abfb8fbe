"""A workdir belongs to one run: one live process at a time (`workdir_lock`), and no folder left
behind by a run refused for bad input (`refused_workdir`)."""
