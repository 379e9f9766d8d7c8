"""The embedded default on one machine: `moerl run` (run.py) and its loop (embedded.py), process
handling (procs.py), the chaos harness (chaos.py) and the run report (report.py)."""
