"""Trainer plug-ins: strategies, checkpointing and exact resume, guards, optimizers and schedules, host memory, progress."""
