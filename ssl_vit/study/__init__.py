"""The model-comparison study of `scripts/study.py`: its jobs (`jobs`) and its summary table
(`summary`)."""
