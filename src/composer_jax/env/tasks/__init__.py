"""Tasks on disk (the Harbor layout): the task.toml spec and store, grading a workspace with the
task's verifier, `env validate`, and the parametrised task families."""
