"""A training stage (pretrain, finetune) around the loop of runner/train: its data opened and
checked (`fit`), the datasets of in-training evaluation, a classifier's or a contrastive model's
parts (`contrastive`), then the loop (`run`)."""
