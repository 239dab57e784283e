"""Trainer plug-ins: strategies, checkpointing and resume, guards, optimizers and schedules, host memory, progress."""
