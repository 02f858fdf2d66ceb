"""Ray actors: one actor hosts one loaded stack and writes its own shards."""
