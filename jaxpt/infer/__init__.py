"""Running a trained model: restore a checkpoint anywhere, the one greedy decoding loop, and KV-cached generation."""
