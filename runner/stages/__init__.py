"""What the subcommands (runner/tasks) are made of: the steps every stage takes (`common`), training
(`training`, `contrastive`, `fit`), the checkpoints an evaluation runs (`members`, `zero_shot`),
named datasets (`dataset_specs`, `fewshot_data`) and what a run ran on (`environment`)."""
