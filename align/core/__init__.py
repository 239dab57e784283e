"""Pure tensor math with pinned-value tests: log-probs, masks, statistics, KL, advantages, losses, packing."""
