"""What a run's committed trajectories become for training: SFT Parquet (chat messages, TRL names),
RL prompts with their pass rates, OpenAI batch files, and the dataset card beside them (`genrun export`)."""
