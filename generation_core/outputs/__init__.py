"""What a finished run leaves: the merged DataProto, manifest.json, exports, publishing, status."""
