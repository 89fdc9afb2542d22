"""Training machinery shared by the jobs: run start-up, schedules, optimizers, the training
step (`step.TrainStep`) and loop (`runner.TrainLoop`), checkpoints (the one module that saves
and loads state) and metrics."""
