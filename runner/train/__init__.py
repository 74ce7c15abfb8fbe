"""Training: state, pure train step, loop, optimizers, schedules, losses."""
