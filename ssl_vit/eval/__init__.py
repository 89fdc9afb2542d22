"""Evaluation of frozen encoders: few-shot linear regression (`fewshot`) and the end-to-end
job that extracts features and runs it (`fewshot_job`)."""
