"""What a run reads: the bundled defaults, dataset files, a shard's rows, agent loops and the user's code."""
