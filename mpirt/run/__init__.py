"""Running a job: the config (config), start-up (distributed), job control (jobctl), fault
injection (faults), the training script (train), sampling (sample), SLURM scripts (slurm) and
``python -m mpirt.schedule`` (schedule)."""
