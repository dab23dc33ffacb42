"""What a run reads: dataset files, a shard's rows, tasks, OpenAI batch files, the tokenizer, agent loops and the user's code."""
