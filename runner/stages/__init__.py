"""What the subcommands (runner/tasks) are made of: the steps every stage takes (`common`), training
(`training`, `contrastive`, `fit`), the checkpoints an evaluation runs (`members`, `zero_shot`), the
datasets named on the command line (`dataset_specs`, `fewshot_data`) and the record of what a run
ran on (`environment`)."""
