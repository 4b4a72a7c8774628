"""A run's records: the JSONL files written from any process (through one sink actor on the driver's node), and what
reads them back: the summary, the pictures, the comparison of two runs."""
