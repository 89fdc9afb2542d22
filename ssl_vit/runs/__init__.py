"""Run directories, below the jobs that write them and the tools that must not (torch-free):
`lock` (one job at a time holds a run directory, claimed on the main process) and `occupancy`
(what a command must not write into, replace or remove: a run, a checkpoint, a source).
Training (`train.rundir`), evaluation's outputs (`eval.select_output`), export and import use
them alike."""
