"""A run's control and records: stopping it cleanly, its log, its JSONL records, their report and pictures."""
