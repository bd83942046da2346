"""What keeps a run safe. A reader adapting the template may skip this folder: train_distribute.py calls it.

settings   the constants at the top of the script as the command line, and every check before anything starts
start      the start rule (new, resume, restart or finished), one run per OUTPUT_DIR, earlier results moved aside
files      rank 0's files: written atomically on a background thread (checkpoint, CSV, picture)
failures   stop signals, and the one place that turns a failure into its line and exit code"""
