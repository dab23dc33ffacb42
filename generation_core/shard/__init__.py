"""One shard's job: agent loops streaming trajectories, rewards, parts written and committed."""
