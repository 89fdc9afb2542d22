"""Training machinery shared by the jobs: run start-up, schedules, optimizers, the training
step (`step.TrainStep`) and the parts of the loops (`loop`), checkpoints (the one module that saves
and loads state) and metrics."""
