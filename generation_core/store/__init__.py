"""Where bytes live: any folder (local or fsspec), a run folder's names and records, the commit log, the lease, run.json."""
