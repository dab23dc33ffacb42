"""What a finished run leaves: the merged DataProto, manifest.json, publishing, status."""
