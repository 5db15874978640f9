"""The fuzz tier: hostile and damaged inputs against bitguard's CLI, ingest and upload API (harness.py)."""
