"""What every stage (a subcommand's run: pretrain, finetune, eval, ...) does first (`setup`): join
the job, check the config against the devices and build the mesh, check that restored parameters
fit their model."""
