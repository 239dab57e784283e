"""Prompts to scored rollouts: rollout sources, generation engines, rewards and environment episodes (no optimizer)."""
