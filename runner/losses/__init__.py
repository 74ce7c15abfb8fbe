"""The losses a model is trained and judged by: classification (`classification`) and image-text
contrastive (`contrastive`). Pure functions of outputs and labels, below the train step and the
evaluators that both use them."""
