"""Studies: drivers that run a paper's comparison end to end with real `vmoe` commands."""
