"""The math of one training step and what it updates: the train/eval steps, the sharded train state, the optimizer, the stability policy, the batch-size ramp, FLOP and memory accounting."""
