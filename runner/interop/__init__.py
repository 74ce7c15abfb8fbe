"""Reading checkpoints written by other code bases."""
