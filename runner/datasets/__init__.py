"""Datasets named on the command line (eval.datasets, fewshot.datasets, OOD datasets) as full
data configs and batches, read with the evaluated model's preprocessing (`dataset_specs`), and
few-shot problems sampled from them (`fewshot_data`)."""
