"""A run: launching it (``areal-plugins train``), its startup checks, its environment on a Ray cluster, its
progress lines, stopping it cleanly, its log, its JSONL records, their report and pictures."""
