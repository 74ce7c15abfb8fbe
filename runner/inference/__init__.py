"""The checkpoints an evaluation runs, as one model (`members`): one checkpoint, several (a deep
ensemble), MC-dropout samples, or a contrastive run's towers as a zero-shot classifier
(`zero_shot`)."""
