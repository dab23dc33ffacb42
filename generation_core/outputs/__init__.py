"""What a finished run leaves: the merged DataProto, the capacity ledger, manifest.json and the run summary, status."""
