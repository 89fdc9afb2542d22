"""Training machinery shared by the jobs: run start-up, schedules, optimizers, checkpoints
(the one module that saves and loads state) and metrics."""
