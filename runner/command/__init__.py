"""The `vmoe` command line (runner/cli.py), one job per module: the process it runs in
(allocator), its arguments and a sweep's jobs (arguments), composing configs and explaining why
one does not compose (compose), the checks before anything runs (preflight; the key ranges of
Hydra's launchers and sweepers: launchers), running a stage as Hydra's task (job), the table a
sweep prints when it ends (sweep_table, a Hydra callback) and the schemas given to Hydra
(config_store).

The library's own modules (models, data, training, evaluators, tasks: JAX and TensorFlow) are
imported inside the functions that need them, deliberately: a command first restarts itself with
jemalloc and quiets TensorFlow's environment (allocator), which must happen before those
libraries load, and `vmoe --help` or `vmoe summarize` need none of them."""
